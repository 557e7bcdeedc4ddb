"""A plain i-quant quantizer for tests (gguf-py writes none of the i-quants; llama.cpp's quantizer is not here):
float rows [n, 256 m] -> the type's blocks, read back by gguf-py's dequantizer in the tests that use it.

Per sub-block of values sharing a scale, a few candidate scales (fractions of max|x| / the largest level); per
candidate every 8 (IQ3: 4) magnitudes go to their nearest grid entry (signs from x; where the 8th sign is a parity
bit, the smallest value's sign gives way, as llama.cpp does), IQ1 tries both deltas; the candidate with the least
squared error wins. The scales are then stored in the type's few bits (a super-block d, 3-6 bit multipliers) and
the entries chosen again for the stored scale. Simpler than llama.cpp's search (no importance weights, no
iterative refinement), so its error is a little larger than a real file's: a fair test of an error model that must
pass real files."""

from __future__ import annotations

import numpy as np
import torch

from mlaserve.gguf.iq_grids import IQ4NL_VALUES
from mlaserve.gguf.iquants import grid as _grid

FRACTIONS = (0.55, 0.7, 0.85, 1.0)


def _nearest(a: torch.Tensor, grid: torch.Tensor, db: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [G, w] magnitudes (or signed values for IQ1), grid [N, w], db [G] -> (entry [G], squared error [G])."""
    idx = torch.empty(a.shape[0], dtype=torch.int64)
    err = torch.empty(a.shape[0], dtype=torch.float64)
    g32 = grid.float()
    g2 = (g32 * g32).sum(1)
    for c in range(0, a.shape[0], 8192):  # [chunk, N] scores in float32 (the choice only; errors in float64)
        ac, dc = a[c : c + 8192], db[c : c + 8192, None]
        score = torch.addmm(g2[None, :], ac.float() / dc.float(), g32.T, alpha=-2.0)
        best = score.argmin(1)
        idx[c : c + 8192] = best
        err[c : c + 8192] = ((ac - dc * grid[best]) ** 2).sum(1)
    return idx, err


def _signs_parity(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [G, 8] -> (the magnitudes to fit, 7 sign bits [G]): where the minus count is odd the smallest value's sign
    gives way, and its magnitude to fit is -|x| (the entry's smallest level is then the nearest)."""
    neg = x < 0
    odd = neg.sum(1) % 2 == 1
    smallest = x.abs().argmin(1)
    flip = torch.zeros_like(neg)
    flip[torch.arange(x.shape[0]), smallest] = odd
    neg = neg ^ flip
    bits = (neg[:, :7].long() << torch.arange(7)).sum(1)
    return torch.where(flip, -x.abs(), x.abs()), bits


def _signs8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.abs(), ((x < 0).long() << torch.arange(8)).sum(1)


def _fp16_bytes(d: torch.Tensor) -> np.ndarray:
    return d.to(torch.float16).numpy().view(np.uint8).reshape(-1, 2)


def _best_scale(x: torch.Tensor, width: int, sub: int, top: float, fit) -> torch.Tensor:
    """x [S, sub] sub-blocks -> the candidate scale [S] with the least error; fit(a [G, width], db [G]) -> err [G]."""
    amax = x.abs().amax(1).clamp_min(1e-12)
    best, best_err = None, None
    for f in FRACTIONS:
        db = amax * f / top
        err = fit(x.reshape(-1, width), db.repeat_interleave(sub // width)).reshape(x.shape[0], -1).sum(1)
        if best is None:
            best, best_err = db, err
        else:
            take = err < best_err
            best, best_err = torch.where(take, db, best), torch.where(take, err, best_err)
    return best


def _multipliers(db: torch.Tensor, per: int, bits: int, form) -> tuple[torch.Tensor, torch.Tensor]:
    """db [B * per] ideal scales -> (fp16-rounded d [B], multiplier codes [B, per]) with form(code) the factor."""
    db = db.reshape(-1, per)
    codes = torch.arange(2**bits, dtype=torch.float64)
    factors = form(codes)
    d = (db.amax(1) / factors.max()).to(torch.float16).to(torch.float64).clamp_min(1e-8)
    q = ((db / d[:, None]).unsqueeze(-1) - factors).abs().argmin(-1)
    return d, q


def quantize(x: np.ndarray, name: str) -> np.ndarray:
    """x [n, K] float32 (K a multiple of 256; IQ4_NL: of 32) -> [n, K / block * type_size] uint8 blocks."""
    return QUANTIZERS[name](torch.from_numpy(np.array(x, dtype=np.float32)).double().reshape(-1, 256))


# ------------------------------------------------------------------------------------------ IQ4


def _iq4_codes(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(IQ4NL_VALUES, dtype=torch.float64)
    return ((x / torch.where(d != 0, d, 1.0)[:, None]).unsqueeze(-1) - table).abs().argmin(-1)


def _iq4_fit(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(IQ4NL_VALUES, dtype=torch.float64)
    return ((x - d[:, None] * table[_iq4_codes(x, d)]) ** 2).sum(1)


def _pack_nibbles(codes: torch.Tensor) -> np.ndarray:  # [G, 32] -> [G, 16]: value j low nibble, j + 16 high
    c = codes.numpy().astype(np.uint8)
    return c[:, :16] | (c[:, 16:] << 4)


def _q_iq4_nl(x: torch.Tensor) -> np.ndarray:
    xs = x.reshape(-1, 32)
    d = _best_scale(xs, 32, 32, 127.0, _iq4_fit).to(torch.float16).to(torch.float64)
    out = np.zeros((xs.shape[0], 18), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    out[:, 2:] = _pack_nibbles(_iq4_codes(xs, d))
    return out


def _q_iq4_xs(x: torch.Tensor) -> np.ndarray:
    xs = x.reshape(-1, 32)
    d, ls = _multipliers(_best_scale(xs, 32, 32, 127.0, _iq4_fit), 8, 6, lambda c: c - 32)
    dl = d[:, None] * (ls - 32).double()
    codes = _iq4_codes(xs, dl.reshape(-1))
    out = np.zeros((x.shape[0], 136), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    lsn = ls.numpy()
    hi = ((lsn >> 4) << (2 * np.arange(8))).sum(1).astype(np.uint16)
    out[:, 2:4] = hi.view(np.uint8).reshape(-1, 2)
    lo = (lsn & 15).astype(np.uint8)
    out[:, 4:8] = lo[:, 0::2] | (lo[:, 1::2] << 4)
    out[:, 8:] = _pack_nibbles(codes).reshape(-1, 128)
    return out


# ------------------------------------------------------------------------------------------ grids


def _grid_fit(grid: torch.Tensor, signs):
    def fit(a: torch.Tensor, db: torch.Tensor) -> torch.Tensor:
        mags, _ = signs(a) if signs is not None else (a, None)
        if grid.shape[1] == 4:
            idx, err = _nearest(mags.reshape(-1, 4), grid, db.repeat_interleave(2))
            return err.reshape(-1, 2).sum(1)
        return _nearest(mags, grid, db)[1]

    return fit


def _q_grid8(x: torch.Tensor, gname: str, half: bool, signs, form, bits: int):
    """Shared by IQ2_XXS / IQ2_XS / IQ2_S: per 32 (half: 16) values a scale code, per 8 values an entry + signs."""
    grid = _grid(gname).double()
    sub = 16 if half else 32
    xs = x.reshape(-1, sub)
    d, sc = _multipliers(_best_scale(xs, 8, sub, 43.0, _grid_fit(grid, signs)), 256 // sub, bits, form)
    db = (d[:, None] * form(sc.double())).reshape(-1).repeat_interleave(sub // 8)
    mags, sb = signs(x.reshape(-1, 8))
    idx, _ = _nearest(mags, grid, db)
    return d, sc, idx.reshape(x.shape[0], 32), sb.reshape(x.shape[0], 32)


def _half_form(c):
    return (0.5 + c) * 0.25


def _q_iq2_xxs(x: torch.Tensor) -> np.ndarray:
    d, sc, idx, sb = _q_grid8(x, "IQ2XXS", False, _signs_parity, _half_form, 4)
    out = np.zeros((x.shape[0], 66), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    q = out[:, 2:].reshape(-1, 8, 8)
    q[:, :, :4] = idx.reshape(-1, 8, 4).numpy()
    aux = (sb.reshape(-1, 8, 4) << torch.tensor([0, 7, 14, 21])).sum(-1) | (sc << 28)
    q[:, :, 4:] = aux.numpy().astype(np.uint32).view(np.uint8).reshape(-1, 8, 4)
    return out


def _q_iq2_xs(x: torch.Tensor) -> np.ndarray:
    d, sc, idx, sb = _q_grid8(x, "IQ2XS", True, _signs_parity, _half_form, 4)
    out = np.zeros((x.shape[0], 74), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    out[:, 2:66] = (idx | (sb << 9)).numpy().astype(np.uint16).view(np.uint8).reshape(-1, 64)
    s = sc.numpy().astype(np.uint8)
    out[:, 66:74] = s[:, 0::2] | (s[:, 1::2] << 4)
    return out


def _q_iq2_s(x: torch.Tensor) -> np.ndarray:
    d, sc, idx, sb = _q_grid8(x, "IQ2S", True, _signs8, _half_form, 4)
    out = np.zeros((x.shape[0], 82), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    i = idx.numpy()
    out[:, 2:34] = i & 255
    out[:, 34:66] = sb.numpy()
    out[:, 66:74] = ((i >> 8).reshape(-1, 8, 4) << (2 * np.arange(4))).sum(-1)
    s = sc.numpy().astype(np.uint8)
    out[:, 74:82] = s[:, 0::2] | (s[:, 1::2] << 4)
    return out


def _q_iq3(x: torch.Tensor, gname: str, signs, form, top: float):
    grid = _grid(gname).double()
    xs = x.reshape(-1, 32)
    d, sc = _multipliers(_best_scale(xs, 8, 32, top, _grid_fit(grid, signs)), 8, 4, form)
    db = (d[:, None] * form(sc.double())).reshape(-1).repeat_interleave(8)
    mags, sb = signs(x.reshape(-1, 8))
    idx, _ = _nearest(mags.reshape(-1, 4), grid, db)
    return d, sc, idx.reshape(x.shape[0], 64), sb.reshape(x.shape[0], 32)


def _q_iq3_xxs(x: torch.Tensor) -> np.ndarray:
    d, sc, idx, sb = _q_iq3(x, "IQ3XXS", _signs_parity, lambda c: (0.5 + c) * 0.5, 62.0)
    out = np.zeros((x.shape[0], 98), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    out[:, 2:66] = idx.numpy()
    aux = (sb.reshape(-1, 8, 4) << torch.tensor([0, 7, 14, 21])).sum(-1) | (sc << 28)
    out[:, 66:98] = aux.numpy().astype(np.uint32).view(np.uint8).reshape(-1, 32)
    return out


def _q_iq3_s(x: torch.Tensor) -> np.ndarray:
    d, sc, idx, sb = _q_iq3(x, "IQ3S", _signs8, lambda c: 1 + 2 * c, 15.0)
    out = np.zeros((x.shape[0], 110), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    i = idx.numpy()
    out[:, 2:66] = i & 255
    out[:, 66:74] = ((i >> 8).reshape(-1, 8, 8) << np.arange(8)).sum(-1)
    out[:, 74:106] = sb.numpy()
    s = sc.numpy().astype(np.uint8)
    out[:, 106:110] = s[:, 0::2] | (s[:, 1::2] << 4)
    return out


# ------------------------------------------------------------------------------------------ IQ1


def _iq1_fit(grid: torch.Tensor, per_group_delta: bool):
    """err of 8 values to dl (entry + delta), the better delta per group (IQ1_M) or per 32 values (IQ1_S)."""

    def fit(a: torch.Tensor, dl: torch.Tensor) -> torch.Tensor:
        e = [_nearest(a - dl[:, None] * s * 0.125, grid, dl)[1] for s in (1.0, -1.0)]
        if per_group_delta:
            return torch.minimum(*e)
        return torch.minimum(e[0].reshape(-1, 4).sum(1), e[1].reshape(-1, 4).sum(1)).repeat_interleave(4) / 4

    return fit


def _q_iq1(x: torch.Tensor, sub: int, per_group_delta: bool):
    grid = _grid("IQ1S").double()
    xs = x.reshape(-1, sub)
    d, sc = _multipliers(
        _best_scale(xs, 8, sub, 1.125, _iq1_fit(grid, per_group_delta)), 256 // sub, 3, lambda c: 2 * c + 1
    )
    dl = (d[:, None] * (2 * sc.double() + 1)).reshape(-1).repeat_interleave(sub // 8)
    a = x.reshape(-1, 8)
    cand = [_nearest(a - dl[:, None] * s * 0.125, grid, dl) for s in (1.0, -1.0)]
    err = torch.stack([cand[0][1], cand[1][1]], 1)  # [G, 2]
    if not per_group_delta:
        err = err.reshape(-1, 4, 2).sum(1).repeat_interleave(4, 0)
    neg = err[:, 1] < err[:, 0]
    idx = torch.where(neg, cand[1][0], cand[0][0])
    return d, sc, idx.reshape(x.shape[0], 32), neg.reshape(x.shape[0], 32)


def _q_iq1_s(x: torch.Tensor) -> np.ndarray:
    d, sc, idx, neg = _q_iq1(x, 32, False)
    out = np.zeros((x.shape[0], 50), np.uint8)
    out[:, :2] = _fp16_bytes(d)
    i = idx.numpy()
    out[:, 2:34] = i & 255
    qh = ((i >> 8).reshape(-1, 8, 4) << (3 * np.arange(4))).sum(-1) | (sc.numpy() << 12)
    qh |= neg.numpy().reshape(-1, 8, 4)[:, :, 0].astype(np.int64) << 15
    out[:, 34:50] = qh.astype(np.uint16).view(np.uint8).reshape(-1, 16)
    return out


def _q_iq1_m(x: torch.Tensor) -> np.ndarray:
    d, sc, idx, neg = _q_iq1(x, 16, True)
    out = np.zeros((x.shape[0], 56), np.uint8)
    i = idx.numpy()
    out[:, :32] = i & 255
    nib = (i >> 8) | (neg.numpy().astype(np.int64) << 3)
    out[:, 32:48] = nib[:, 0::2] | (nib[:, 1::2] << 4)
    words = (sc.numpy().reshape(-1, 4, 4) << (3 * np.arange(4))).sum(-1)  # half h: word h / 4, bits 3 (h % 4)
    dbits = d.to(torch.float16).numpy().view(np.uint16).astype(np.int64)
    words |= ((dbits[:, None] >> (4 * np.arange(4))) & 0xF) << 12
    out[:, 48:56] = words.astype(np.uint16).view(np.uint8).reshape(-1, 8)
    return out


QUANTIZERS = {
    "IQ4_NL": _q_iq4_nl,
    "IQ4_XS": _q_iq4_xs,
    "IQ2_XXS": _q_iq2_xxs,
    "IQ2_XS": _q_iq2_xs,
    "IQ2_S": _q_iq2_s,
    "IQ3_XXS": _q_iq3_xxs,
    "IQ3_S": _q_iq3_s,
    "IQ1_S": _q_iq1_s,
    "IQ1_M": _q_iq1_m,
}
