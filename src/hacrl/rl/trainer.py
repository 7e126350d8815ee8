"""Policy updates: a DeepSpeed engine (CPU accelerator, gloo, world size 1 here; GPUs and more
ranks through the DeepSpeed launcher elsewhere) around a client ``torch.optim.AdamW``.

The HF checkpoint (weights) and the recovery state (optimizer, RNG, update counter) are kept
apart: a ZeRO state saved at one world size does not load at another (measured here),
while the HF export always does.
"""

from __future__ import annotations

import logging
import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hacrl.config.schema import TrainerConfig
from hacrl.errors import NonFiniteLossError, UnsafeStateError

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Initialise torch.distributed for a single local rank (gloo on 127.0.0.1) if needed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    init_method = None
    if os.environ.get("WORLD_SIZE", "1") != "1":
        # the ranks of a multi-process update meet through a file (no store listening on a
        # port) and gloo talks over the loopback interface only
        init_method = os.environ.get("HACRL_DIST_INIT")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # unused by the file rendezvous, but DeepSpeed turns to MPI discovery (and fails: no
        # mpi4py) when they are missing, as they are in a fresh `hacrl stage` process
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    else:
        # a single local rank: always a fresh port on 127.0.0.1. A MASTER_PORT inherited from a
        # parent that ran an update itself (a service started from it, say) may still be taken.
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    import deepspeed

    if not torch.cuda.is_available():
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (35-45 s of C++,
        # redone whenever its build flags differ between processes): one rank never reduces,
        # and gloo reduces the ranks of a multi-process update
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    kw = {}
    if init_method:
        kw = dict(init_method=init_method, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl",
                               verbose=False, **kw)


def world() -> tuple[int, int]:
    """(rank, world size) of this process (0, 1 outside a multi-process update)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass
class TrainState:
    """Counters of the recovery state (optimizer and RNG states travel in the same checkpoint)."""

    updates: int = 0


def _state_globals() -> list:
    """What a recovery state may hold besides tensors and containers: numpy's RNG state array,
    and the three plain data classes DeepSpeed's ZeRO 1-2 optimizer files hold (a loss-scaler
    record, a fragment address, the ZeRO stage enum; none defines ``__setstate__`` or
    ``__reduce__``, so unpickling them only sets attributes)."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32"))]
    try:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        allowed += [LossScaler, ZeroStageEnum, fragment_address]
    except ImportError:  # the torch backend's states hold none of them
        pass
    return allowed


def check_state_file(path: Path) -> None:
    """Refuse a recovery-state file that could run code when unpickled.

    The file is read first by torch's weights-only unpickler, which builds tensors, numbers,
    strings, containers and (allowed here) numpy arrays, and nothing else: a planted pickle that
    calls ``os.system`` fails there, before any code of it runs. DeepSpeed (which unpickles its
    checkpoints with ``weights_only=False``) then loads the same bytes, which can only rebuild
    those types. Raises :class:`UnsafeStateError` naming the file.
    """
    try:
        with torch.serialization.safe_globals(_state_globals()):
            torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any refusal: say which file and why, one line
        why = str(e).splitlines()
        hint = next((ln.strip() for ln in why if "GLOBAL" in ln or "Unsupported" in ln), why[0] if why else "")
        raise UnsafeStateError(f"{path}: refusing to load this recovery state: it is not only tensors, numbers "
                               f"and arrays ({type(e).__name__}: {hint[:200]}); was it replaced? Delete "
                               f"{path.parent} and re-run the stage that wrote it") from None


def capture_rng() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def seed_rng(seed: int) -> None:
    """Seed torch, numpy and Python's global generators (numpy's and Python's start from OS
    entropy otherwise, so a saved RNG state would differ from run to run)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def restore_rng(rng: dict) -> None:
    if not rng:
        return
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])


def _grad_norm(module) -> float:
    sq = [p.grad.detach().float().pow(2).sum() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(sq).sum().sqrt()) if sq else 0.0


def _inner_adamw(opt) -> torch.optim.AdamW | None:
    """The torch AdamW that steps the (fp32 master) weights: the optimizer itself, or the one a
    DeepSpeed wrapper (ZeRO, BF16) holds as ``.optimizer``; None for any other optimizer."""
    for _ in range(4):
        if isinstance(opt, torch.optim.AdamW):
            return opt
        opt = getattr(opt, "optimizer", None)
    return None


UPDATE_CHUNK = 1 << 24
"""Elements per piece when the update's norm is computed: the temporaries stay at 64 MB in fp32
whatever the largest tensor (a 262k-token embedding has 0.5 G elements at width 2048)."""


@torch.no_grad()
def update_to_weight(opt, partitioned: bool) -> float | None:
    """||theta_t - theta_{t-1}|| / ||theta_{t-1}|| of the AdamW step just taken: how far one
    optimizer update moved the weights, relative to their size ("small step" measured on the
    model, not read off the learning rate).

    Recovered from AdamW's own state rather than from a copy of the weights (which would double
    the trainer's memory): torch's AdamW sets theta_t = theta_{t-1} (1 - lr wd) - lr u with
    u = (m_t / (1 - beta1^t)) / (sqrt(v_t / (1 - beta2^t)) + eps), so theta_{t-1} and the step
    follow from theta_t, m_t, v_t and t. ``partitioned``: the master weights are split over the
    data-parallel ranks (ZeRO, DeepSpeed's BF16 optimizer), so the squared norms are summed over
    ranks. None when the optimizer is not AdamW."""
    inner = _inner_adamw(opt)
    if inner is None:
        return None
    # both squared norms accumulate where the weights live: one host transfer per step, not one
    # per piece (a GPU sync each), and the ranks' sum runs on the communication backend's device
    first = next((p for g in inner.param_groups for p in g["params"]), None)
    if first is None:
        return None
    acc = torch.zeros(2, dtype=torch.float64, device=first.device)  # every rank reduces, even one holding nothing
    for g in inner.param_groups:
        lr, wd, eps = g["lr"], g["weight_decay"], g["eps"]
        b1, b2 = g["betas"]
        for p in g["params"]:
            st = inner.state.get(p, {})
            if "exp_avg" not in st:
                continue
            t = float(st["step"])
            bc1, bc2 = 1 - b1 ** t, (1 - b2 ** t) ** 0.5
            for th, m, v in zip(p.detach().reshape(-1).split(UPDATE_CHUNK), st["exp_avg"].reshape(-1).split(UPDATE_CHUNK),
                                st["exp_avg_sq"].reshape(-1).split(UPDATE_CHUNK)):
                # u = (m / bc1) / (sqrt(v) / bc2 + eps); prev = (th + lr u) / (1 - lr wd);
                # step = lr u + lr wd prev: the same operations in the same order as written out,
                # in place (a fresh 64 MB temporary per operation cost more than the arithmetic)
                th, m, v = th.float(), m.float(), v.float()
                den = v.sqrt().div_(bc2).add_(eps)
                u = torch.div(m, bc1).div_(den)
                del den
                prev = torch.mul(u, lr).add_(th).div_(1 - lr * wd)
                step = u.mul_(lr).add_(torch.mul(prev, lr * wd))
                acc[0] += step.pow_(2).sum(dtype=torch.float64)
                acc[1] += prev.pow_(2).sum(dtype=torch.float64)
                del u, prev, step
    if partitioned:
        import torch.distributed as dist

        dist.all_reduce(acc)
    d2, w2 = acc.tolist()
    return (d2 ** 0.5) / (w2 ** 0.5) if w2 > 0 else None


WORLD_FILE = "world.json"


class PolicyOptimizer:
    """One learner's model + optimizer behind DeepSpeed (or plain torch)."""

    def __init__(self, model, cfg: TrainerConfig, samples_per_update: int):
        self.cfg = cfg
        self.base_lr = cfg.lr
        params = [p for p in model.parameters() if p.requires_grad]
        # foreach: what torch picks on a GPU anyway; on a CPU the same bits as its default
        # one-tensor-at-a-time loop (tested) in 0.36x the time (one pass per operation over all
        # tensors, not a Python loop), for transient buffers of about one copy of the weights
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                      weight_decay=cfg.weight_decay, foreach=True)
        if cfg.backend == "deepspeed":
            import deepspeed

            init_distributed()
            ds_config = {
                "train_micro_batch_size_per_gpu": max(1, samples_per_update),
                "gradient_accumulation_steps": 1,
                "gradient_clipping": cfg.grad_clip,
                "zero_optimization": {"stage": cfg.zero_stage},
                "bf16": {"enabled": cfg.dtype == "bf16"},
                # bf16 with ZeRO >= 1: micro-batch gradients accumulate in fp32 (DeepSpeed's BF16
                # optimizer); ZeRO 0 accumulates them in the model's bf16
                **({"data_types": {"grad_accum_dtype": "fp32"}} if cfg.dtype == "bf16" and cfg.zero_stage >= 1 else {}),
                "steps_per_print": 10**9,
                "wall_clock_breakdown": False,
            }
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=model, optimizer=optimizer, config=ds_config)
            self.module = self.engine.module
            if world()[1] == 1 and cfg.zero_stage == 0:
                # one rank: its "all-reduce" flattens every gradient into a buffer, divides it by
                # 1 and copies it back (bit for bit the gradients it started from): 0.7 s a step
                # on average over the pretrained pair's updates on 2 cores
                self.engine.enable_backward_allreduce = False
        else:
            self.engine = None
            self.optimizer = optimizer
            self.module = model
        self.state = TrainState()
        self._accumulating = False
        self.last_update_to_weight: float | None = None
        """||delta theta|| / ||theta|| of the last optimizer step (:func:`update_to_weight`)."""
        self.last_skipped = False
        """The last update's gradient was exactly zero and ``skip_empty_updates`` skipped its step."""
        self.skipped = 0
        """Updates skipped so far by this optimizer (see :meth:`_skip`)."""

    @property
    def model(self):
        """The callable used for the forward pass (the engine when there is one)."""
        return self.engine if self.engine is not None else self.module

    def zero_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A stand-in for ``loss`` (its value checked finite) whose backward gives every trainable
        parameter an all-zero gradient without a pass through the model: for a micro-batch whose
        loss reaches no weight (``rl.step.reaches_model``). The optimizer then steps exactly as
        after the full backward (zero gradients, not absent ones: AdamW still applies its momentum
        and weight decay; ranks still reduce)."""
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"non-finite loss {loss.item()} at update {self.state.updates}")
        return sum(p.sum() * 0.0 for p in self.module.parameters() if p.requires_grad)

    def step(self, loss: torch.Tensor) -> float:
        """Backward + clipped optimizer step with the ramped learning rate for a whole mini-batch
        (one micro-batch that is also the last); returns the gradient norm."""
        return self.micro_step(loss, last=True)

    def micro_step(self, loss: torch.Tensor, last: bool) -> float | None:
        """Backward of one micro-batch's share of a mini-batch's loss (gradients accumulate); after
        the ``last`` one, the clipped optimizer step with the ramped learning rate, as :meth:`step`
        does for a whole mini-batch (returns the gradient norm then, else None). The share is the
        micro-batch's part of the mini-batch's loss (:mod:`hacrl.rl.micro`): nothing is rescaled."""
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"non-finite loss {loss.item()} at update {self.state.updates}")
        if self.engine is not None:
            # DeepSpeed's boundary set by hand (the number of micro-batches varies per update): the
            # gradients are reduced across ranks and stepped on at the last one only
            self.engine.set_gradient_accumulation_boundary(last)
            self.engine.backward(loss)
            if not last:
                return None
            lr = self.base_lr * min(1.0, (self.state.updates + 1) / max(1, self.cfg.lr_warmup_updates))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            own = _grad_norm(self.module)
            if self._skip(own):
                self.engine.zero_grad()
                return 0.0
            self.engine.step()
            gn = self.engine.get_global_grad_norm()
            gn = float(gn) if gn is not None else own
        else:
            if not self._accumulating:
                self.optimizer.zero_grad(set_to_none=True)
                self._accumulating = True
            loss.backward()
            if not last:
                return None
            self._accumulating = False
            lr = self.base_lr * min(1.0, (self.state.updates + 1) / max(1, self.cfg.lr_warmup_updates))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            gn = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip))
            if self._skip(gn):
                return 0.0
            self.optimizer.step()
        if not np.isfinite(gn):
            raise NonFiniteLossError(f"non-finite gradient norm at update {self.state.updates}")
        self.last_skipped = False
        self.state.updates += 1
        # a wrapped AdamW (ZeRO, BF16) holds this rank's partition of the master weights
        self.last_update_to_weight = update_to_weight(
            self.optimizer, partitioned=_inner_adamw(self.optimizer) is not self.optimizer and world()[1] > 1)
        return gn

    def _skip(self, grad_norm: float) -> bool:
        """Whether this update's step is skipped: its gradient is exactly zero (over every rank)
        and ``skip_empty_updates`` is on. A skipped update moves nothing and counts no update."""
        empty = grad_norm == 0.0
        if world()[1] > 1:  # every rank must take the same branch: zero only where all are
            import torch.distributed as dist

            flag = torch.tensor([0.0 if empty else 1.0], dtype=torch.float64,
                                device=f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(flag)
            empty = float(flag) == 0.0
        self.last_skipped = bool(empty and self.cfg.skip_empty_updates)
        if self.last_skipped:
            self.last_update_to_weight = None
            self.skipped += 1
        return self.last_skipped

    def save_state(self, out_dir: Path) -> None:
        """Recovery state (optimizer + RNG + counter) into ``out_dir`` (a fresh directory)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        client = {"updates": self.state.updates, "rng": capture_rng()}
        # a ZeRO 1-2 state is partitioned by rank: say at which world size it was saved, so a
        # resume at another one knows what it cannot load (see load_state)
        import json

        rank, ws = world()
        if rank == 0:
            (out_dir / WORLD_FILE).write_text(json.dumps({"world_size": ws, "updates": self.state.updates,
                                                          "zero_stage": self.cfg.zero_stage}))
        if self.engine is not None:
            # only optimizer + client state matter; weights travel in the HF checkpoint
            self.engine.save_checkpoint(str(out_dir), tag="state", client_state=client,
                                        save_latest=False)
        else:
            torch.save({"optimizer": self.optimizer.state_dict(), **client}, out_dir / "state.pt")

    def load_state(self, state_dir: Path) -> None:
        """Restore the optimizer/RNG state if ``state_dir`` holds one (iteration 0 holds none).

        A state saved at another world size (ZeRO partitions it by rank, and DeepSpeed refuses
        to load it), or with ZeRO off where it is now on or the reverse (the files differ),
        restores the update counter only: the weights come from the HF checkpoint as always,
        Adam's moments restart from zero, and the RNG keeps the step's seed."""
        import json

        _, ws = world()
        saved = json.loads((state_dir / WORLD_FILE).read_text()) if (state_dir / WORLD_FILE).exists() else None
        saved_ws = saved["world_size"] if saved else 1
        if saved and "zero_stage" in saved:
            saved_zero = int(saved["zero_stage"])
        else:  # a state from before the stage was recorded: ZeRO 1-2 leave partitioned optimizer files
            saved_zero = 1 if any((state_dir / "state").glob("zero_pp_rank_*")) else 0
        zero_moved = (saved_zero > 0) != (self.cfg.zero_stage > 0)  # ZeRO 1 and 2 share one format
        if (state_dir / "state").is_dir() and ((saved_ws != ws and self.cfg.zero_stage > 0) or zero_moved):
            counter = saved["updates"] if saved else 0
            log.warning("recovery state in %s was saved at world size %d with ZeRO %d, this update runs at "
                        "%d with ZeRO %d: the optimizer state does not load across these; Adam's moments "
                        "restart from zero (weights: the HF checkpoint; update counter: %d, kept)",
                        state_dir, saved_ws, saved_zero, ws, self.cfg.zero_stage, counter)
            self.state.updates = int(counter)
            return
        for f in sorted(state_dir.rglob("*.pt")):  # before anything unpickles them
            check_state_file(f)
        if (state_dir / "state").is_dir() and self.engine is not None:
            _, client = self.engine.load_checkpoint(str(state_dir), tag="state",
                                                    load_optimizer_states=True,
                                                    load_lr_scheduler_states=False)
        elif (state_dir / "state.pt").exists() and self.engine is None:
            with torch.serialization.safe_globals(_state_globals()):
                client = torch.load(state_dir / "state.pt", map_location="cpu", weights_only=True)
            self.optimizer.load_state_dict(client["optimizer"])
        else:
            return
        self.state.updates = int(client.get("updates", 0))
        restore_rng(client.get("rng", {}))
