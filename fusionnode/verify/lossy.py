"""Comparing what a worker sent over a lossy link (AdaTopK, `--compress topk:R|fp16`) with a recompute.

The worker commits to the encoded message it sends (commitment.py), so the verifier sees exactly the
codec, its parameters and its payload. It recomputes the stage's output (or input gradient) `y` from
the same decoded inputs and parameters, and accepts the message only where it is what the job's codec
settings make of `y`, within the codec's own error bound plus the compute tolerance `rel_tol`
(compare.py: 1e-4 on CPU):

- the codec must be one the job's link settings allow for that direction (`LinkRules.codecs`: a
  liar cannot pick another), and its parameters must be the job's (top-k mode, value dtype,
  centering); a top-k keep ratio must be the job's fixed `topk:R` or, under AdaTopK, at least its
  floor `k_min` (the ratio follows the link's measured speed, which the driver cannot know: a liar
  can at most send as sparsely as a worker on the slowest allowed link), and `k` must be the count
  that ratio gives;
- raw: the plain comparison (compare.py);
- fp16: every element within its own float16 rounding of the recompute, plus the compute's slack:
  ``|got_i - y_i| <= (u + rel_tol) |y_i| + rel_tol rms(y) + h`` with u = 2^-11, float16's unit
  roundoff, and h = 2^-25 (half its smallest subnormal step): a per-element bound, so a liar
  cannot spend a whole tensor's error budget on a few chosen coordinates;
- topk: the channel means sent must be those of `y` within ``2u + rel_tol`` (relative L2); the
  sent indices must be a valid top-k of the recomputed centered tensor within tolerance (every
  unsent element's magnitude at most the smallest sent one's plus ``rel_tol * max|c|``: exact ties,
  and near-ties a recompute's summation order moves, may go either way); the sent values must be the
  recomputed ones at those indices, each within its own rounding as fp16's are (u of the value
  dtype: 2^-11 float16, 2^-8 bfloat16, 0 float32; rms over the whole centered tensor). A 1% scaling
  moves every sent value by 1e-2, about 17 times the float16 bound;
- q8/q4 (per-row absmax, Q = 127 / 7): each row's scale must be ``max|y_row| / Q`` within rel_tol
  (a 1% scaling of a row moves it by 1e-2); every element must lie on one of the two grid points
  around its recomputed value (``|got - y| <= s (1 + e)``, e = rel_tol Q + 1e-3 grid units; half a
  step for round-to-nearest), and, with stochastic rounding (unbiased, of known variance
  ``f (1 - f) s^2`` per element, f the fractional grid position), two z-tests over each block of
  independent dither: the error's correlation with `y` (a scaling that keeps each row's largest
  element) and its excess variance (added noise) must both stay under Z_LIMIT standard errors;
  with the job's keyed dither (link option ``dither`` "keyed", compress/dither.py) the checker
  knows each element's ``u`` and asks for the exact grid point ``floor(y / s + u)``: only where
  ``y / s + u`` lies within the recompute's slack (e grid units) of a grid boundary may it go
  either way, so a worker cannot steer its rounding (the per-link counter seed it replaces let
  it couple the directions to any vector orthogonal to ``y``: review finding 4).

Error feedback (`error_feedback`) sends what earlier messages dropped: no recompute can reproduce it,
so a job with it is not spot-checked (train/checks.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import fusionnode.compress.quant  # registers "q8" and "q4" (the check process decodes them)
import fusionnode.compress.topk  # noqa: F401 - registers "topk"
from fusionnode.verify.compare import Mismatch, compare_tensor

Z_LIMIT = 6.0  # standard errors a quantized message's bias / excess-variance statistic may reach
GRID_SLACK = 1e-3  # grid units of slack on a quantized element's distance to its recomputed value
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 0.0}
# half the smallest subnormal step: the absolute rounding error of values under the normal range
SUBNORMAL_HALF_STEP = {"float16": 2.0**-25, "bfloat16": 2.0**-134, "float32": 0.0}
FLOAT16_MAX = 65504.0
DITHER_ELEMENTS = 1 << 16  # compress/quant.py _CHUNK_ELEMENTS: its dither block repeats every chunk


@dataclass(frozen=True)
class LinkRules:
    """The codec settings a job's links use (the driver's: `--compress` and its link options)."""

    kind: str = "none"  # none | fp16 | topk | adatopk
    ratio: float | None = None  # topk:R's fixed keep ratio
    k_min: float = 0.2
    mode: str = "global"
    value_dtype: str = "float16"
    center: bool = True
    center_gradients: bool = False
    grad_codec: str = "q8"
    warmup_codec: str = "q8"
    stochastic: bool = True
    error_feedback: bool = False
    dither: str = "keyed"  # q8/q4 stochastic rounding's seed: "keyed" (compress/dither.py) or "counter"
    job: str = ""  # the job's id (keys the dither)

    @classmethod
    def of(cls, compress: str | None, link_options: Mapping[str, Any] | None, job: str = "") -> LinkRules:
        from fusionnode.compress.link import LinkOptions
        from fusionnode.compress.policy import parse_compress

        spec = parse_compress(str(compress or "none"))
        o = LinkOptions.from_dict(dict(link_options or {}))
        return cls(
            spec.kind, spec.ratio, o.k_min, o.mode, o.value_dtype, o.center, o.center_gradients,
            o.grad_codec, o.warmup_codec, o.stochastic, o.error_feedback, o.dither, str(job or ""),
        )  # fmt: skip

    def seed(self, at: tuple[int, int, int] | None, key: str, name: str) -> int | None:
        """The keyed q8/q4 dither seed of tensor `name` in the `key` message stage/step/micro-batch
        `at` sent; None where the job's links round to nearest or count their seeds."""
        if at is None or not self.stochastic or self.dither != "keyed":
            return None
        from fusionnode.compress.dither import dither_seed

        stage, step, mb = at
        return dither_seed(self.job, stage, step, mb, key, name)

    @property
    def lossy(self) -> bool:
        return self.kind != "none"

    def codecs(self, key: str) -> set[str]:
        """Codecs a floating tensor of a `key` ("act" | "grad") message may come in."""
        if self.kind == "none":
            return {"raw"}
        if self.kind == "fp16":
            return {"raw", "fp16"}
        out = {"raw", "fp16", "topk" if key == "act" else self.grad_codec}
        if self.warmup_codec != "raw":
            out.add(self.warmup_codec)
        return out


def _close(
    name: str, got: torch.Tensor, want: torch.Tensor, tol: float, what: str, floor: float = 0.0
) -> Mismatch | None:
    """Relative L2 within `tol`, plus an absolute `floor` (float64)."""
    diff = float((got.double() - want.double()).norm())
    ref = float(want.double().norm())
    if not diff <= tol * ref + floor + 1e-30:
        return Mismatch(name, f"{what}: relative error {diff / max(ref, 1e-30):.3g} > {tol:.3g}")
    return None


def _rounded(
    name: str, got: torch.Tensor, want: torch.Tensor, dtype: str, rel_tol: float, what: str
) -> Mismatch | None:
    """Each element of `got` within its own rounding to `dtype` of the recomputed `want`, plus the
    compute's slack: ``|got_i - y_i| <= (u + rel_tol) |y_i| + rel_tol rms(y) + h`` (u the dtype's unit
    roundoff, h half its smallest subnormal step). A per-element bound: no error budget over the
    whole tensor a liar could spend on a few chosen coordinates."""
    g, w = got.double().reshape(-1), want.double().reshape(-1)
    if not w.numel():
        return None
    rms = float(w.pow(2).mean().sqrt())
    bound = (UNIT_ROUNDOFF[dtype] + rel_tol) * w.abs() + rel_tol * rms + SUBNORMAL_HALF_STEP[dtype]
    off = (g - w).abs() - bound
    if bool((off > 0).any()):
        i = int(off.argmax())
        return Mismatch(
            name,
            f"{what}: {int((off > 0).sum())} elements beyond their {dtype} rounding, element {i} "
            f"{float(g[i]):.6g} where the recompute gives {float(w[i]):.6g}",
        )
    return None


def compare_sent(
    name: str,
    enc: Any,
    got: torch.Tensor,
    want: torch.Tensor,
    rules: LinkRules,
    key: str,
    rel_tol: float,
    seed: int | None = None,
) -> Mismatch | None:
    """None when `enc` (what the worker sent, `got` decoded) is what the job's link codec makes of the
    recomputed `want`, within the bounds of the module docstring; else what differs. `seed`: the
    keyed dither of a stochastically rounded q8/q4 message (`LinkRules.seed`)."""
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return Mismatch(name, f"{got.dtype}{list(got.shape)} instead of {want.dtype}{list(want.shape)}")
    if not got.is_floating_point() or enc.codec == "raw":
        if enc.codec != "raw":
            return Mismatch(name, f"an integer tensor sent as {enc.codec!r}")
        return compare_tensor(name, got, want, rel_tol)
    if enc.codec not in rules.codecs(key):
        return Mismatch(
            name, f"codec {enc.codec!r}, which this job's links (--compress {rules.kind}) do not use"
        )
    want = want.detach().float()
    got = got.detach().float()
    if not bool(torch.isfinite(want).all()):
        return Mismatch(name, "the recompute is not finite")
    if enc.codec == "fp16":
        return _rounded(name, got, want.clamp(-FLOAT16_MAX, FLOAT16_MAX), "float16", rel_tol, "fp16")
    if enc.codec == "topk":
        return _check_topk(name, enc, want, rules, key, rel_tol)
    return _check_quant(name, enc, got, want, rules, rel_tol, seed)


# ----------------------------------------------------------------- top-k


def split_topk(enc: Any) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(channel means or None, flat indices, values) of a "topk" message (validated as decode does)."""
    from fusionnode.compress import topk as tk

    p = tk._validated_params(enc, math.prod(enc.shape))
    numel, k, encoding, value_dtype = p["numel"], p["k"], p["index"], p["values"]
    row_len = p.get("row_len")
    channels = enc.shape[-1] if p["center"] else 0
    center_bytes = channels * tk.VALUE_BYTES[value_dtype]
    data = memoryview(enc.data)
    index_bytes = tk.bitmap_bytes(numel) if encoding == tk.BITMAP else k * tk.INDEX_LISTS[encoding][0]
    if len(data) != center_bytes + index_bytes + k * tk.VALUE_BYTES[value_dtype]:
        raise ValueError("topk payload of the wrong size")
    values = tk._values_from_bytes(data, center_bytes + index_bytes, k, value_dtype).float()
    raw = data[center_bytes : center_bytes + index_bytes]
    if encoding == tk.BITMAP:
        idx = tk._decode_bitmap(raw, numel, k, row_len).nonzero().squeeze(1)
    else:
        idx = tk._decode_index_list(raw, encoding, numel, k, row_len)
    mean = tk._values_from_bytes(data, 0, channels, value_dtype).float() if channels else None
    return mean, idx, values


def _check_topk(
    name: str, enc: Any, y: torch.Tensor, rules: LinkRules, key: str, rel_tol: float
) -> Mismatch | None:
    from fusionnode.compress.topk import keep_count

    p = enc.params
    mode_want = rules.mode if y.dim() >= 2 else "global"
    center_want = rules.center and (key != "grad" or rules.center_gradients) and y.dim() >= 1
    ratio = p.get("ratio")
    if (
        p.get("mode") != mode_want
        or p.get("values") != rules.value_dtype
        or bool(p.get("center")) != center_want
    ):
        return Mismatch(name, f"top-k settings {dict(p)} are not this job's")
    if rules.kind == "topk" and ratio != rules.ratio:
        return Mismatch(name, f"keep ratio {ratio} instead of the job's {rules.ratio}")
    # the floor is AdaTopK's: a fixed topk:R link sends R as given, even under k_min
    floor = rules.k_min - 1e-9 if rules.kind == "adatopk" else 0.0
    if not (isinstance(ratio, float | int) and floor <= ratio <= 1.0):
        return Mismatch(name, f"keep ratio {ratio} under the job's floor {rules.k_min}")
    numel = y.numel()
    row_len = int(y.shape[-1]) if mode_want == "row" else None
    k_want = keep_count(numel, ratio) if row_len is None else (numel // row_len) * keep_count(row_len, ratio)
    if p.get("k") != k_want:
        return Mismatch(name, f"k={p.get('k')} where keep ratio {ratio} gives {k_want}")
    try:
        mean, idx, values = split_topk(enc)
    except Exception as exc:  # a malformed message is a mismatch, whatever the codec raised
        return Mismatch(name, f"undecodable top-k message: {exc}")
    u = UNIT_ROUNDOFF[rules.value_dtype]
    flat = y.reshape(-1)
    c = flat
    if mean is not None:
        channels = int(y.shape[-1])
        want_mean = flat.view(-1, channels).double().mean(dim=0).float()
        # the compute's own differences, at most rel_tol of the tensor's RMS per channel
        floor = rel_tol * float(flat.double().pow(2).mean().sqrt()) * math.sqrt(channels)
        bad = _close(name, mean, want_mean, 2 * u + rel_tol, "channel means", floor)
        if bad is not None:
            return bad
        c = (flat.view(-1, channels) - mean).reshape(-1)  # centered with what the worker subtracted
    mag = c.abs()
    slack = rel_tol * float(mag.max()) if numel else 0.0
    sent = torch.zeros(numel, dtype=torch.bool)
    sent[idx] = True
    if row_len is None:
        lo = float(mag[sent].min()) if bool(sent.any()) else math.inf
        hi = float(mag[~sent].max()) if bool((~sent).any()) else 0.0
        valid = hi <= lo + slack
    else:
        m2, s2 = mag.view(-1, row_len), sent.view(-1, row_len)
        lo_r = torch.where(s2, m2, torch.full_like(m2, math.inf)).amin(dim=1)
        hi_r = torch.where(s2, torch.zeros_like(m2), m2).amax(dim=1)
        valid = bool((hi_r <= lo_r + slack).all())
        lo, hi = float(lo_r.min()), float(hi_r.max())
    if not valid:
        return Mismatch(
            name, f"the sent indices are not a top-k of the recompute ({hi:.4g} left out, {lo:.4g} sent)"
        )
    want_vals = c[idx]
    if rules.value_dtype == "float16":
        want_vals = want_vals.clamp(-FLOAT16_MAX, FLOAT16_MAX)
    # each value within its own rounding of the recomputed one (the compute slack: rms of all of c)
    rms_c = float(c.double().pow(2).mean().sqrt()) if numel else 0.0
    off = (values.double() - want_vals.double()).abs() - (
        (u + rel_tol) * want_vals.double().abs() + rel_tol * rms_c + SUBNORMAL_HALF_STEP[rules.value_dtype]
    )
    if bool((off > 0).any()):
        i = int(off.argmax())
        return Mismatch(
            name,
            f"top-k values: {int((off > 0).sum())} beyond their {rules.value_dtype} rounding, at index "
            f"{int(idx[i])} {float(values[i]):.6g} where the recompute gives {float(want_vals[i]):.6g}",
        )
    return None


# ----------------------------------------------------------------- q8 / q4


def _check_quant(
    name: str,
    enc: Any,
    got: torch.Tensor,
    y: torch.Tensor,
    rules: LinkRules,
    rel_tol: float,
    seed: int | None,
) -> Mismatch | None:
    from fusionnode.compress.quant import QMAX, quant_rows

    qmax = QMAX[enc.codec]
    rows, row_len = quant_rows(tuple(y.shape))
    if rows == 0:
        return None
    sdtype = enc.params.get("scale")
    np_scale = "<f4" if sdtype == "float32" else "<f2"
    s = torch.from_numpy(np.frombuffer(memoryview(enc.data), dtype=np_scale, count=rows).astype(np.float64))
    y2 = y.reshape(rows, row_len).double()
    g2 = got.reshape(rows, row_len).double()
    absmax = y2.abs().amax(dim=1)
    s_want = absmax / qmax
    u = 0.0 if sdtype == "float32" else 2 * UNIT_ROUNDOFF["float16"]
    floor = max(float(s_want.max()), 1e-30) * rel_tol
    off = (s - s_want).abs() - (u + rel_tol) * s_want - floor
    if bool((off > 0).any()):
        r = int(off.argmax())
        return Mismatch(
            name, f"row {r}'s scale {float(s[r]):.6g} instead of max|y|/{qmax} = {float(s_want[r]):.6g}"
        )
    err = g2 - y2
    step = s.clamp_min(1e-30).unsqueeze(1)
    reach = 1.0 if rules.stochastic else 0.5
    dist = (err.abs() / step) - (reach + GRID_SLACK + rel_tol * qmax)
    live = s > 0
    if bool((dist[live] > 0).any()) or bool((err[~live] != 0).any()):
        return Mismatch(
            name, f"{int((dist[live] > 0).sum())} elements off the quantization grid around the recompute"
        )
    if not rules.stochastic:
        return None
    if seed is not None:
        bad = _keyed_grid(name, g2, y2, step, live, seed, qmax, GRID_SLACK + rel_tol * qmax)
        if bad is not None:
            return bad
    f = torch.where(live.unsqueeze(1), y2 / step - torch.floor(y2 / step), torch.zeros_like(y2))
    var = f * (1 - f) * step**2  # each element's rounding error variance, known from y
    fourth = (f * (1 - f) ** 4 + (1 - f) * f**4) * step**4
    block = max(1, DITHER_ELEMENTS // max(row_len, 1))  # rows per independent dither block
    for start in range(0, rows, block):
        sl = slice(start, start + block)
        e, yy, v = err[sl], y2[sl], var[sl]
        sd_bias = math.sqrt(float((yy**2 * v).sum()))
        if sd_bias > 0:
            z = float((e * yy).sum()) / sd_bias
            if abs(z) > Z_LIMIT:
                return Mismatch(
                    name, f"quantization error correlated with the recompute (z = {z:.1f}): scaled"
                )
        sd_var = math.sqrt(float((fourth[sl] - v**2).clamp_min(0).sum()))
        if sd_var > 0:
            z = float((e**2 - v).sum()) / sd_var
            if z > Z_LIMIT:
                return Mismatch(
                    name, f"quantization error larger than rounding explains (z = {z:.1f}): noise added"
                )
    return None


def _keyed_grid(
    name: str,
    g2: torch.Tensor,
    y2: torch.Tensor,
    step: torch.Tensor,
    live: torch.Tensor,
    seed: int,
    qmax: int,
    slack: float,
) -> Mismatch | None:
    """Every element of a live row on the grid point ``floor(y / s + u)`` the keyed dither `u` gives,
    or on its neighbour where ``y / s + u`` is within `slack` grid units of the boundary between them."""
    from fusionnode.compress.quant import dither_rows

    rows, row_len = y2.shape
    w = y2 / step + dither_rows(seed, rows, row_len).double()
    lo = torch.floor(w - slack).clamp(-qmax, qmax)
    hi = torch.floor(w + slack).clamp(-qmax, qmax)
    q = torch.round(g2 / step)
    off = ((q < lo) | (q > hi)) & live.unsqueeze(1)
    if bool(off.any()):
        r, c = (int(i) for i in off.nonzero()[0])
        return Mismatch(
            name,
            f"{int(off.sum())} elements not on the grid point the job's dither gives (row {r} element {c}: "
            f"{int(q[r, c])} where floor(y / s + u) = {int(torch.floor(w[r, c]).clamp(-qmax, qmax))}): "
            "rounding steered",
        )
    return None


def compare_sent_all(
    got: Mapping[str, torch.Tensor],
    enc: Mapping[str, Any],
    want: Mapping[str, torch.Tensor],
    rules: LinkRules,
    key: str,
    rel_tol: float,
    what: str,
    at: tuple[int, int, int] | None = None,
) -> list[Mismatch]:
    """`compare_sent` over a message's tensors (missing or extra names included); `at`: the (stage,
    step, micro-batch) that sent it, which keys a q8/q4 dither (`LinkRules.seed`)."""
    out = []
    for name in sorted(set(got) | set(want)):
        label = f"{what} {name}"
        if name not in got or name not in enc:
            out.append(Mismatch(label, "missing"))
        elif name not in want:
            out.append(Mismatch(label, "not expected"))
        else:
            m = compare_sent(
                label, enc[name], got[name].detach().cpu(), want[name].detach().cpu(), rules, key, rel_tol,
                rules.seed(at, key, name),
            )  # fmt: skip
            if m is not None:
                out.append(m)
    return out


__all__ = [
    "FLOAT16_MAX",
    "UNIT_ROUNDOFF",
    "Z_LIMIT",
    "LinkRules",
    "compare_sent",
    "compare_sent_all",
    "split_topk",
]
