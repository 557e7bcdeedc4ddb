"""The DeepSeek-V4 stack, run over chunks of one or more sequences, continuing each sequence's state.

Notation
  S tokens of the chunk at positions start .. start+S-1 (start = state.length), N hc_mult, D hidden, V vocab
  ids [S] -> embed [S, D] -> streams h [S, N, D] (the embedding copied N times)
  per layer:  post, comb, x = attn_hc(h);  h = expand(post, comb, attention(input_layernorm(x)), h)
              post, comb, x = ffn_hc(h);   h = expand(post, comb, moe(post_attention_layernorm(x), ids), h)
  logits [S, V] = lm_head(norm(hc_head(h)))
forward_spans runs several sequences' chunks in one step (the reference attention loops over them; the engine's,
with a LayerStep per layer, reads every sequence's keys at once; the rest is batched);
forward is its one-sequence form. One pass over a prompt, the same prompt in chunks of any sizes, and token by
token all run this forward with a fresh state; the state carries exactly what the next chunk needs (state.py). Module and parameter names are
transformers' DeepseekV4ForCausalLM's (loading/deepseek_v4.py maps the released and save_pretrained layouts onto them).
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.config.deepseek_v4 import DeepseekV4Config
from mlaserve.config.v4_numerics import TRANSFORMERS, V4Numerics
from mlaserve.kernels import native_v4, registry
from mlaserve.kernels.registry import KernelSwitch
from mlaserve.models.deepseek_v4.attention import Span, V4Attention
from mlaserve.models.deepseek_v4.hyper import HyperConnection, make_head
from mlaserve.models.deepseek_v4.moe import V4MoEBlock
from mlaserve.models.deepseek_v4.norm import RMSNorm
from mlaserve.models.deepseek_v4.rope import StepRope, V4RopeTables
from mlaserve.models.deepseek_v4.state import LayerState, SequenceState
from mlaserve.models.deepseek_v4.step_update import LayerStep
from mlaserve.models.layers import embedding


def _ffn_fits(layer: V4DecoderLayer, ctx: registry.KernelContext) -> str | None:
    """The one-call FFN sublayer runs where the plan made each part it fuses native: both hyper-connections
    (hyper_connection), the FFN norm (norm) and the MoE block (moe_block), all planned before this op."""
    why = registry.needs_native(ctx)
    if why is not None:
        return why
    parts = (layer.attn_hc, layer.ffn_hc, layer.post_attention_layernorm)
    if not all(registry.runs_native(m) for m in parts):
        return "a hyper-connection or the FFN norm not native"
    return None if layer.mlp.native_block is not None else "the MoE block not one native call (op moe_block)"


def _ffn_contract(layer: V4DecoderLayer) -> str:
    return f"one call for steps of up to {layer.mlp.native_block.max_tokens} fp32 tokens, else per_op"


registry.register("v4_ffn", "native", _ffn_fits, registry.set_kernel("native"), _ffn_contract)
registry.register("v4_ffn", "per_op", registry.always, registry.set_kernel("per_op"))


class V4DecoderLayer(KernelSwitch, nn.Module):
    # the FFN sublayer (the attention's new streams, the FFN's mixing, norm, MoE block and output streams):
    # native one C call (csrc/v4_ffn.c) where the plan made each of its parts native, else the parts in turn
    KERNEL_OP = "v4_ffn"
    KERNEL_CALLS = {"ffn": {"native": "_ffn_native", "per_op": "_ffn_per_op"}}

    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = V4Attention(cfg, layer)
        self.mlp = V4MoEBlock(d, cfg.moe, cfg.vocab_size, hashed=cfg.mlp_layer_types[layer] == "hash_moe")
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.attn_hc = HyperConnection(d, cfg.hc, eps)
        self.ffn_hc = HyperConnection(d, cfg.hc, eps)
        self.kernel = "per_op"  # the reference; the loader's KernelPlan sets the engine's (binds self.ffn)

    def forward(
        self,
        h: torch.Tensor,
        ids: torch.Tensor,
        positions: torch.Tensor,
        spans: list[Span],
        tables: V4RopeTables,
        csa_dense: bool = False,
        step: LayerStep | None = None,
    ) -> torch.Tensor:
        post, comb, x = self.attn_hc(h)
        y = self.self_attn(self.input_layernorm(x), positions, spans, tables, csa_dense, step)
        return self.ffn(h, post, comb, y, ids)

    def _ffn_per_op(
        self, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The attention's output y [S, D] into the streams h [S, N, D] (its mixing post, comb), then the FFN
        sublayer -> the layer's output streams: each part by its own module (the reference)."""
        h = self.attn_hc.expand(post, comb, y, h)
        post, comb, x = self.ffn_hc(h)
        return self.ffn_hc.expand(post, comb, self.mlp(self.post_attention_layernorm(x), ids), h)

    def _ffn_native(
        self, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """_ffn_per_op in one C call (csrc/v4_ffn.c mls_v4_ffn: the same five C calls the parts' native forms make,
        in the same order, so the same bits), where those parts also ran ~15 tensor ops and their Python. Its
        contract on the step's input: fp32 CPU tokens, at most the MoE block's max_tokens, else the parts."""
        block, f, n = self.mlp.native_block, self.ffn_hc, self.post_attention_layernorm
        fits = all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (h, post, comb, y))
        if h.shape[0] > block.max_tokens or not fits:
            return self._ffn_per_op(h, post, comb, y, ids)
        return native_v4.v4_ffn(
            h.contiguous(), post.contiguous(), comb.contiguous(), y.contiguous(),
            (f.fn, f.base, f.scale, f.eps, f.norm_eps, f.iters), (n.weight, n.eps),
            (block.args, ids.to(torch.int64).contiguous() if block.hashed else None),
        )  # fmt: skip


class V4Model(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.hc_mult = cfg.hc.hc_mult
        self.embed_tokens = embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head = make_head(d, cfg.hc, cfg.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, numerics: V4Numerics = TRANSFORMERS) -> None:
        super().__init__()
        self.config = cfg
        self.model = V4Model(cfg)
        self.set_numerics(numerics)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # derived from the config, never loaded (plain attributes survive a meta-device build)
        self.tables = V4RopeTables(cfg.rope)

    def set_numerics(self, numerics: V4Numerics) -> None:
        """DeepSeek's official-code roundings (config/v4_numerics.py), set on every layer before any forward
        (the loaders build the model from its config alone; the runner sets the engine's choice)."""
        self.numerics = numerics
        for layer in self.model.layers:
            layer.self_attn.set_numerics(numerics)

    def new_state(self, max_tokens: int) -> SequenceState:
        # the activations' dtype: the embedding's output (a GGUF holder's weight is its stored uint8 bytes, and
        # GGUFEmbedding says the dtype it returns)
        e = self.model.embed_tokens
        dtype = getattr(e, "dtype", None) or e.weight.dtype
        return SequenceState(self.config, max_tokens, dtype, self.lm_head.weight.device)

    def forward(self, ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """ids [S] (the next S tokens of the sequence) -> logits [S, V]; advances `state` by S tokens."""
        s, start = ids.shape[0], state.length
        if s == 0:
            raise ValueError("a chunk has at least one token")
        if start + s > state.max_tokens:
            raise ValueError(f"sequence of {start + s} tokens exceeds the state's max_tokens={state.max_tokens}")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"token id {int(ids[i])} at chunk index {i} (position {start + i}) is outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )
        positions = torch.arange(start, start + s, device=ids.device)
        hidden = self.forward_spans(ids, positions, [(0, s, start, state.layers)])
        state.length = start + s
        return self.lm_head(hidden)

    def forward_spans(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        spans: list[tuple[int, int, int, list[LayerState]]],
        csa_dense: bool = False,
        steps: list[LayerStep] | None = None,
        streams: bool = False,
    ) -> torch.Tensor:
        """The tokens of several sequences in one step -> final hidden [T, D] (before lm_head); with `streams`
        the mHC streams after the last layer [T, N, D] instead (before hc_head: what the MTP layer reads). ids, positions
        [T]; per sequence (first row, tokens, position of its first token, its per-layer states). Embedding,
        mHC, norms, projections and the MoE run over all T tokens at once; attention reads the spans' keys in a
        loop (steps None) or all at once (models/deepseek_v4/attention.py). csa_dense: the CSA layers attend every visible compressed row (the
        route's choice, V4Serving). steps: per layer the batched state update (V4Serving; None: the
        per-sequence reference updates each span's states)."""
        m = self.model
        h = m.embed_tokens(ids).unsqueeze(1).expand(-1, m.hc_mult, -1).contiguous()
        tables = StepRope(self.tables, positions)  # the step's cos / sin once per table, not once per layer
        for i, layer in enumerate(m.layers):
            h = layer(
                h,
                ids,
                positions,
                [(a, n, start, states[i]) for a, n, start, states in spans],
                tables,
                csa_dense,
                steps[i] if steps is not None else None,
            )
        return h if streams else self.head_hidden(h)

    def head_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The streams after the last layer [T, N, D] -> the final hidden [T, D] (hc_head, norm)."""
        return self.model.norm(self.model.hc_head(h))

    @torch.no_grad()
    def generate_greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """Prefill the prompt in one pass, then decode one token at a time through the state."""
        state = self.new_state(len(prompt) + new_tokens)
        device = self.lm_head.weight.device
        logits = self(torch.tensor(prompt, device=device), state)
        out = []
        for _ in range(new_tokens):
            token = int(logits[-1].argmax())
            out.append(token)
            if len(out) == new_tokens:
                break
            logits = self(torch.tensor([token], device=device), state)
        return out
