"""One llama.cpp context at long context, served to benchmarks/long_context_llamacpp.py over JSON lines (a process
of its own: llama.cpp through llama-cpp-python's low-level C API, no torch here).

    python benchmarks/llamacpp_session.py '{"path": ..., "threads": 1, "cache": "q8_0", "n_seq": 8, "per_seq": N}'

Notation (llama.cpp's MLA cache, src/llama-kv-cache.cpp): with an MLA model llama.cpp keeps one K row per token
and layer, the latent [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)] = 320 values here, in type_k (f16 or q8_0:
34 bytes per 32 values), and no V tensor (V is a view of the first kv_lora_rank values of K); a quantized K is
rotated by a Hadamard matrix before it is stored (attn_rot_k). One stream per sequence (kv_unified off).

Calls (one JSON object per line in, one out; {"ok": true, "result": ...} or {"ok": false, "error": ...}):
  prefill(tokens)           -> {seconds, tokens}: a real prefill of sequence 0 from position 0, n_batch at a time
  tile_check()              -> {max_abs_diff}: the next token's logits after the prefill vs after tile(P)
  tile(n)                   -> {seconds, bytes}: sequence 0 holds n cells: its own rows from the prefill above
                               (P tokens, through llama.cpp's cache write), repeated to n positions and restored
                               with llama_state_seq_set_data (the same bytes a real prefill would leave per row)
  fork(n_seq)               -> sequences 1..n_seq-1 become copies of sequence 0 (llama_memory_seq_cp across
                               streams: a real copy of the rows, done at the next decode)
  decode(n_seq, steps, warmup, pos) -> {step_s: [...]}: single-token steps of n_seq sequences at positions pos..,
                               then the steps' cells removed (the cache is back at pos cells)
  logits(tokens, out)       -> writes every position's logits [T, vocab] as float32 .npy to `out`
  info()                    -> llama.cpp's system info, the context's parameters, the cache lines of its log
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import struct
import sys
import time
import types

from worker_protocol import error_reply, private_stdout, serve_calls

TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml_type
N_BATCH, N_UBATCH = 2048, 512  # llama.cpp's defaults


def import_llama_cpp():
    """llama-cpp-python's C API module. Its package __init__ also imports the high-level API, whose dependencies
    (diskcache, jinja2) an install with --no-deps lacks; the C API needs none of them, so it is loaded alone."""
    try:
        import llama_cpp

        return llama_cpp
    except ModuleNotFoundError as ex:
        if ex.name == "llama_cpp" or importlib.util.find_spec("llama_cpp") is None:
            raise SystemExit("llama.cpp: pip install llama-cpp-python==0.3.36 (see benchmarks/README.md)") from ex
    spec = importlib.util.find_spec("llama_cpp")
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["llama_cpp"] = pkg
    return importlib.import_module("llama_cpp.llama_cpp")


class Session:
    def __init__(self, path: str, threads: int, cache: str, n_seq: int, per_seq: int, flash_attn: bool = True) -> None:
        import numpy as np

        lc = self.lc = import_llama_cpp()
        self.np, self.log = np, []
        self._keep_log = lc.llama_log_callback(self._log)
        lc.llama_log_set(self._keep_log, None)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        # no weight repacking into the AMX / repack buffer types: on an AMX CPU llama.cpp moves attn_k_b / attn_v_b
        # there and then finds no backend for the MLA's per-head matmul on them (GGML_ASSERT in ggml-backend.cpp's
        # split_graph at context creation); llama-bench's --no-repack
        mp.use_extra_bufts = False
        self.model = lc.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path} (its log says why)")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_seq * per_seq
        cp.n_batch, cp.n_ubatch, cp.n_seq_max = N_BATCH, N_UBATCH, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = TYPES[cache]
        cp.flash_attn_type = int(flash_attn)  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED: a quantized cache needs it
        cp.kv_unified = False  # one stream per sequence: batch 8 reads 8 caches, as 8 requests do
        cp.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx {cp.n_ctx}, n_seq_max {n_seq}, type_k {cache})")
        self.mem = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(N_BATCH, 0, 1)
        self.params = {
            "n_ctx": cp.n_ctx,
            "n_seq_max": n_seq,
            "n_batch": N_BATCH,
            "n_ubatch": N_UBATCH,
            "type_k": cache,
            "type_v": cache,
            "flash_attn": flash_attn,
            "kv_unified": False,
            "use_extra_bufts": False,
            "threads": threads,
        }
        self.prefix: bytes | None = None  # sequence 0's state after prefill()
        self.n_prefix = 0

    def _log(self, level, text, user_data) -> None:
        line = text.decode(errors="replace")
        if level in (3, 4):  # GGML_LOG_LEVEL_WARN, _ERROR
            sys.stderr.write("[llama.cpp] " + line)
        if "llama_kv_cache" in line and ("size" in line or "attn_rot" in line) or "flash_attn" in line:
            self.log.append(line.strip())

    def _run(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, pos, seq, wants logits); one llama_decode per n_batch items."""
        lc, b = self.lc, self.batch
        for start in range(0, len(items), N_BATCH):
            part = items[start : start + N_BATCH]
            for i, (tok, pos, seq, out) in enumerate(part):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(out)
                b.seq_id[i][0] = seq
            b.n_tokens = len(part)
            rc = lc.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} ({len(part)} tokens from position {part[0][1]})")

    def prefill(self, tokens: list[int]) -> dict:
        self.lc.llama_memory_clear(self.mem, True)
        t0 = time.perf_counter()
        self._run([(t, j, 0, j == len(tokens) - 1) for j, t in enumerate(tokens)])
        seconds = time.perf_counter() - t0
        n = self.lc.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * n)()
        got = self.lc.llama_state_seq_get_data(self.ctx, buf, n, 0)
        if got != n:
            raise RuntimeError(f"llama_state_seq_get_data wrote {got} of {n} bytes")
        self.prefix, self.n_prefix = bytes(buf), len(tokens)
        return {"seconds": seconds, "tokens": len(tokens)}

    def tile(self, n: int) -> dict:
        if self.prefix is None:
            raise RuntimeError("tile() needs a prefill() first (its rows are the ones repeated)")
        blob = tiled_state(self.prefix, self.n_prefix, n)
        self.lc.llama_memory_clear(self.mem, True)
        t0 = time.perf_counter()
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        got = self.lc.llama_state_seq_set_data(self.ctx, buf, len(blob), 0)
        if got != len(blob):
            raise RuntimeError(f"llama_state_seq_set_data read {got} of {len(blob)} bytes (its log says why)")
        pos_max = self.lc.llama_memory_seq_pos_max(self.mem, 0)
        if pos_max != n - 1:
            raise RuntimeError(f"after the restore sequence 0 ends at position {pos_max}, not {n - 1}")
        return {"seconds": time.perf_counter() - t0, "bytes": len(blob)}

    def tile_check(self) -> dict:
        """The restore path against the real one: the next token's logits after the prefill itself and after
        tile(P) (the same P rows and positions, restored from the rewritten state) must be equal."""
        np, p = self.np, self.n_prefix
        got = []
        for restore in (False, True):
            if restore:
                self.tile(p)
            self._run([(7, p, 0, True)])
            got.append(np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, 0), shape=(self.n_vocab,)).copy())
            self.lc.llama_memory_seq_rm(self.mem, 0, p, -1)
        return {"max_abs_diff": float(np.abs(got[0] - got[1]).max()), "positions": p}

    def fork(self, n_seq: int) -> None:
        for s in range(1, n_seq):
            self.lc.llama_memory_seq_rm(self.mem, s, -1, -1)
            self.lc.llama_memory_seq_cp(self.mem, 0, s, -1, -1)

    def decode(self, n_seq: int, steps: int, warmup: int, pos: int) -> dict:
        times = []
        for k in range(warmup + steps):
            t0 = time.perf_counter()
            self._run([(5 + s, pos + k, s, True) for s in range(n_seq)])
            self.np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, n_seq - 1), shape=(self.n_vocab,)).max()
            if k >= warmup:
                times.append(time.perf_counter() - t0)
        for s in range(n_seq):
            if not self.lc.llama_memory_seq_rm(self.mem, s, pos, -1):
                raise RuntimeError(f"llama_memory_seq_rm({s}, {pos}, -1) refused")
        return {"step_s": times}

    def logits(self, tokens: list[int], out: str) -> dict:
        np = self.np
        self.lc.llama_memory_clear(self.mem, True)
        self._run([(t, j, 0, True) for j, t in enumerate(tokens)])
        rows = [
            np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, j), shape=(self.n_vocab,)).copy()
            for j in range(len(tokens))
        ]
        np.save(out, np.stack(rows).astype(np.float32))
        self.lc.llama_memory_clear(self.mem, True)
        return {"positions": len(rows)}

    def info(self) -> dict:
        return {
            "llama_cpp_python": getattr(self.lc, "__version__", None),
            "system_info": self.lc.llama_print_system_info().decode(errors="replace").strip(),
            "context_params": self.params,
            "cache_log": self.log,
        }


def tiled_state(blob: bytes, p: int, n: int) -> bytes:
    """A sequence state (llama_state_seq_get_data's bytes) of p cells at positions 0..p-1 rewritten to hold n cells
    at positions 0..n-1, cell i's rows being cell (i mod p)'s. The layout (llama-context.cpp, llama-kv-cache.cpp):
    magic u32, seq_id i32, then per cache (one for MLA; DSA adds the indexer's): n_stream u32, per stream
    cell_count u32 and, when not 0, per cell (pos i32, n_seq_id u32, seq_ids i32...), v_trans u32, n_layer u32,
    per layer (type i32, row bytes u64, cell_count rows); MLA caches have no V part."""
    out = bytearray(blob[:8])
    off, streams = 8, None
    while off < len(blob):
        (n_stream,) = struct.unpack_from("<I", blob, off)
        if streams is not None and n_stream != streams:  # every cache of a context has the same streams
            raise ValueError(f"sequence state: {len(blob) - off} bytes left over (a V part? not an MLA cache)")
        streams = n_stream
        out += blob[off : off + 4]
        off += 4
        for _ in range(n_stream):
            (count,) = struct.unpack_from("<I", blob, off)
            off += 4
            out += struct.pack("<I", n if count else 0)
            if not count:
                continue
            if count != p:
                raise ValueError(f"sequence state: a stream holds {count} cells, the prefill made {p}")
            for j in range(p):
                pos, n_ids = struct.unpack_from("<iI", blob, off)
                if pos != j or n_ids != 1:
                    raise ValueError(f"sequence state: cell {j} at position {pos} with {n_ids} sequences")
                off += 12
            out += b"".join(struct.pack("<iIi", j, 1, 0) for j in range(n))
            v_trans, n_layer = struct.unpack_from("<II", blob, off)
            out += blob[off : off + 8]
            off += 8
            for _ in range(n_layer):
                _, row = struct.unpack_from("<iQ", blob, off)
                out += blob[off : off + 12]
                off += 12
                rows = blob[off : off + p * row]
                off += p * row
                reps, rest = divmod(n, p)
                out += rows * reps + rows[: rest * row]
    if off != len(blob):
        raise ValueError(f"sequence state: {len(blob) - off} bytes left over (a V part? not an MLA cache)")
    return bytes(out)


def main() -> None:
    init = json.loads(sys.argv[1])
    proto = private_stdout()
    try:
        session = Session(
            init["path"], init["threads"], init["cache"], init["n_seq"], init["per_seq"], init.get("flash_attn", True)
        )
        proto.write(json.dumps({"ok": True}) + "\n")
    except Exception as ex:  # noqa: BLE001 -- the parent reports it
        proto.write(json.dumps(error_reply(ex)) + "\n")
        return
    serve_calls(proto, session)


if __name__ == "__main__":
    main()
