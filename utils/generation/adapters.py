"""LoRA adapters served side by side on one base model, unmerged (library; no side effects).

    adapters = AdapterSet(model, dtype)          one per Engine (``engine.adapters``)
    a = adapters.load(name, entry, source)       an adapter entry (utils/lora.py), checked against
                                                 the base's shapes (ValueError naming the tensor)
    adapters.unload(name) / adapters.get(name)   (KeyError / ValueError for an unknown name)
    with adapters.prefill(a): model.trunk(...)   one sequence's prompt with its adapter
    step = adapters.decode_step(row_adapters)    a decode step's rows (None: all base rows)
    with step.hooks(): decode_pass(...)          the Linear path (CUDA, bf16): forward hooks
    packs = step.packs(pack.layers)              the CPU decode pack's path: products + deltas

What a row computes: every adapted projection gives W x + scale * B A x, with this row's own A
and B (the LoRA of peft, utils/lora.py), never merged into W: rows of other adapters and base
rows (no adapter) share the step's one batch. How (punica/S-LoRA's idea, written as two dense
products): the adapters in use are stacked per projection, A_all (in, N*R) and scale * B_all
(N*R, out) (N adapters, ranks padded with zeros to the largest, R), and a step computes
``((x @ A_all) * mask) @ B_all`` with ``mask`` (rows, N*R) one on each row's own adapter's
R columns and zero elsewhere. A base row's mask is all zero, so its delta is exactly 0 and
its output bit for bit the base model's; a row's delta sums only its own adapter's terms (the
others are exact zeros). The q|k|v and gate|up products of the decode pack are fused, so
their adapters are too (A side by side, B block-diagonal: the zero blocks add exact zeros).
A prompt is prefilled alone, with its own adapter's A and B (forward hooks on the Linear
layers). Cost per step: two products (the decode pack's own, utils/generation/cpu.py, where
it is used), a mask and an add per adapted projection group and layer, whatever the number of
rows; the stack is rebuilt when an adapter is loaded or unloaded.

An unloaded adapter stays in the stack while a row still uses it (its sequence finishes with
it); new requests cannot name it. Not for Infini-attention models (utils/lora.py
``refusal``) nor int8-quantized ones (their projections are not Linear layers).
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from utils import lora

# the decode pack's products (utils/generation/pack.py PackedLayer) and the projections each fuses
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
_serials = itertools.count(1)


@dataclass(eq=False)
class Adapter:
    """One loaded adapter: per (layer, projection) its A^T (in, r) and scale * B^T (r, out) in
    the engine's compute dtype. ``serial``: unique per load (the prefix cache's key: a name
    reloaded with other weights never finds the old one's KV)."""
    name: str
    source: str
    settings: lora.LoraSettings
    a: dict            # (layer, hf projection) -> (in, r)
    b: dict            # (layer, hf projection) -> (r, out), scaled
    serial: int

    @property
    def key(self) -> tuple:
        return ("adapter", self.serial)


def _projection(model, layer: int, proj: str):
    block = model.layers[layer]
    return block.get_submodule(lora.TARGETS[proj])


@contextlib.contextmanager
def _hooked(model, pairs: dict, delta):
    """Forward hooks on the projections ``pairs`` names ({(layer, hf projection): (A, B)}), each
    replacing the projection's output by ``delta(out, x, A, B)``, for the ``with`` block."""
    handles = []

    def hook(A, B):
        return lambda mod, inp, out: delta(out, inp[0], A, B)
    try:
        for (i, proj), (A, B) in pairs.items():
            handles.append(_projection(model, i, proj).register_forward_hook(hook(A, B)))
        yield
    finally:
        for h in handles:
            h.remove()


class AdapterSet:
    """The adapters of one engine's model (see the module docstring)."""

    def __init__(self, model, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self.loaded: dict[str, Adapter] = {}
        self._stack: Optional[_Stack] = None

    def shapes(self) -> dict:
        """{weight name: (out, in)} of the base's projections, as utils.lora.check_entry reads them."""
        return {f"layers.{i}.{path}.weight": (m.out_features, m.in_features)
                for i in range(len(self.model.layers)) for path in lora.TARGETS.values()
                for m in [self.model.layers[i].get_submodule(path)]}

    def load(self, name: str, entry: dict, source: str = "") -> Adapter:
        """Add ``entry`` (utils/lora.py's ``{rank, alpha, ..., weights}``) as ``name``; ValueError
        naming the problem (a name in use, another base's shapes, a damaged tensor)."""
        if name in self.loaded:
            raise ValueError(f"an adapter named '{name}' is already loaded (unload it first)")
        problem = lora.refusal(self.model.args)
        if problem:
            raise ValueError(problem)
        if getattr(self.model, "quantized", None):
            raise ValueError("adapters are not served on an int8-quantized model (serve.quantize none)")
        settings = lora.check_entry(entry, self.shapes())
        dev, w = self.model.device, entry["weights"]
        a, b = {}, {}
        for i in range(len(self.model.layers)):
            for proj in settings.target_modules:
                at = f"layers.{i}.{lora.TARGETS[proj]}"
                a[i, proj] = w[f"{at}.lora_A.weight"].to(dev, torch.float32).t().contiguous().to(self.dtype)
                b[i, proj] = (w[f"{at}.lora_B.weight"].to(dev, torch.float32).t() * settings.scale
                              ).contiguous().to(self.dtype)
        got = Adapter(name, source, settings, a, b, next(_serials))
        self.loaded[name] = got
        return got

    def unload(self, name: str) -> Adapter:
        return self.loaded.pop(self._known(name))

    def get(self, name: str) -> Adapter:
        return self.loaded[self._known(name)]

    def _known(self, name: str) -> str:
        if name not in self.loaded:
            have = ", ".join(self.loaded) or "none"
            raise ValueError(f"no adapter named '{name}' is loaded (loaded: {have})")
        return name

    # -- a prefill: one sequence, one adapter
    @contextlib.contextmanager
    def prefill(self, adapter: Optional[Adapter]):
        """Forward hooks adding ``adapter``'s delta to every projection it targets while the
        block runs (nothing without one)."""
        if adapter is None:
            yield
            return
        pairs = {key: (a, adapter.b[key]) for key, a in adapter.a.items()}
        with _hooked(self.model, pairs, lambda out, x, a, b: out + (x.to(a.dtype) @ a) @ b):
            yield

    # -- a decode step: rows of several adapters and none
    def decode_step(self, rows: list[Optional[Adapter]]) -> Optional["_Step"]:
        """The step of rows whose adapters are ``rows`` (None: a base row); None when no row has
        one (the base step, untouched)."""
        if all(r is None for r in rows):
            return None
        members = tuple(sorted(set(self.loaded.values()) | {r for r in rows if r is not None},
                               key=lambda a: a.serial))
        if self._stack is None or self._stack.members != members:
            self._stack = _Stack(self.model, members, self.dtype)
        return _Step(self._stack, rows)


class _Stack:
    """The adapters in use, stacked per projection (see the module docstring)."""

    def __init__(self, model, members: tuple, dtype: torch.dtype):
        self.model, self.members, self.dtype = model, members, dtype
        self.index = {a.serial: j for j, a in enumerate(members)}
        self.R = max(a.settings.rank for a in members)
        self.n_layers = len(model.layers)
        self.single: dict = {}          # (layer, proj) -> (A_all, B_all)
        self.fused: dict = {}           # (layer, group) -> (A_all, B_all), made at first use
        N, R, dev = len(members), self.R, model.device
        for i in range(self.n_layers):
            for proj in lora.TARGETS:
                m = _projection(model, i, proj)
                if not any((i, proj) in a.a for a in members):
                    continue
                A = torch.zeros(m.in_features, N * R, dtype=dtype, device=dev)
                B = torch.zeros(N * R, m.out_features, dtype=dtype, device=dev)
                for j, a in enumerate(members):
                    if (i, proj) in a.a:
                        r = a.settings.rank
                        A[:, j * R:j * R + r] = a.a[i, proj]
                        B[j * R:j * R + r] = a.b[i, proj]
                self.single[i, proj] = (A, B)

    def group(self, i: int, group: str) -> Optional[tuple]:
        """(A, B) of a fused product (None: no adapter targets any of its projections)."""
        if (i, group) not in self.fused:
            projs = GROUPS[group]
            if not any((i, p) in self.single for p in projs):
                self.fused[i, group] = None
            else:
                NR = len(self.members) * self.R
                outs = [_projection(self.model, i, p).out_features for p in projs]
                d_in = _projection(self.model, i, projs[0]).in_features
                dev = self.model.device
                A = torch.zeros(d_in, NR * len(projs), dtype=self.dtype, device=dev)
                B = torch.zeros(NR * len(projs), sum(outs), dtype=self.dtype, device=dev)
                o = 0
                for k, (p, out) in enumerate(zip(projs, outs)):
                    if (i, p) in self.single:
                        a, b = self.single[i, p]
                        A[:, k * NR:(k + 1) * NR] = a
                        B[k * NR:(k + 1) * NR, o:o + out] = b
                    o += out
                self.fused[i, group] = (A, B)
        return self.fused[i, group]


class _Step:
    """One decode step's per-row deltas over a :class:`_Stack`."""

    def __init__(self, stack: _Stack, rows: list[Optional[Adapter]]):
        self.stack = stack
        n, R, NR = len(rows), stack.R, len(stack.members) * stack.R
        mask = torch.zeros(n, NR, dtype=stack.dtype)
        for r, a in enumerate(rows):
            if a is not None:
                j = stack.index[a.serial]
                mask[r, j * R:(j + 1) * R] = 1
        self.mask = {1: mask.to(stack.model.device)}

    def _mask(self, times: int) -> torch.Tensor:
        if times not in self.mask:
            self.mask[times] = self.mask[1].repeat(1, times)
        return self.mask[times]

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  times: int = 1) -> torch.Tensor:
        """y (n, out) plus each row's own adapter's delta of x (n, in), in one addmm."""
        return torch.addmm(y, (x.to(A.dtype) @ A) * self._mask(times), B.to(y.dtype))

    @contextlib.contextmanager
    def hooks(self):
        """The Linear path of a decode step: each adapted projection adds the rows' deltas."""
        with _hooked(self.stack.model, self.stack.single, self.add_delta):
            yield

    def packs(self, layers: list) -> list:
        """The decode pack's layers (utils/generation/pack.py PackedLayer) with products that add
        the rows' deltas of their fused projections."""
        out = []
        for i, pl in enumerate(layers):
            extra = {}
            for g in GROUPS:
                ab = self.stack.group(i, g)
                if ab is not None:
                    extra[id(getattr(pl, "qkv" if g == "qkv" else g))] = (ab, len(GROUPS[g]))
            if not extra:
                out.append(pl)
                continue

            def mm(x, w, base=pl.mm, extra=extra):
                y = base(x, w)
                got = extra.get(id(w))
                if got is None:
                    return y
                (A, B), times = got                  # the pack's own product: the faster on this CPU
                return y.add_(base(base(x, A).mul_(self._mask(times)), B))
            out.append(pl._replace(mm=mm))
        return out
