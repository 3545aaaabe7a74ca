"""Activation bytes per token: what autograd saves for backward, counted tensor by tensor.

Legend (all per token on this rank): h hidden, d head dim, q = H d and kv = Hkv d (query /
key-value widths), I MLP width, V vocab, a bytes of the compute dtype, t tp, s = t under
sequence parallelism (1 otherwise), c cp. The counts follow the HF Llama/Qwen3 decoder
layer code and shardforge's attention/loss paths; docs/planner.md derives each term.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardforge.algorithms.plan.stats import LayerSpec, ModelStats

__all__ = ["ActivationModel"]


@dataclass(frozen=True, slots=True)
class ActivationModel:
    """Saved-activation and working-set bytes per token for one layout."""

    stats: ModelStats
    a: int
    """Bytes per element of the compute dtype."""
    tp: int
    cp: int
    sequence_parallel: bool
    attention: str
    """'flash' or 'cpu'."""
    expert_tp: int = 1
    tiled_mlp_shards: int = 1
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()

    @property
    def s(self) -> int:
        return self.tp if self.tp > 1 and self.sequence_parallel else 1

    def norm(self, width: int) -> float:
        """RMSNorm over a sequence-sharded input + its output as the next matmul saves it.

        fp32 upcast of the input (4 w), the normalised value before the weight (a w), 1/rms
        (4): computed on this rank's sequence shard (/ s). The output is all-gathered under
        SP and saved whole by the following column-parallel matmul (a w)."""
        return (4 * width + self.a * width + 4) / self.s + self.a * width

    def attention_block(self) -> float:
        st, a, t, c = self.stats, self.a, self.tp, self.cp
        d = st.head_dim
        hq, hkv = st.num_heads // t, max(st.num_kv_heads // t, 1)
        out = 0.0
        if st.qk_norm:  # q_norm / k_norm: fp32 upcast + normalised + 1/rms per head
            out += (4 + a) * d * (hq + hkv) + 4 * (hq + hkv)
        if self.attention == "cpu":
            # Block-diagonal SDPA: gathered copies of q and (GQA-expanded) k, v, the output,
            # the index_copy result (o_proj input), the gather index (int64), logsumexp.
            return out + 5 * a * d * hq + 4 * hq + 8
        kv_heads = max(hkv, c) if c > 1 else hkv  # Ulysses repeats kv heads when fewer than cp
        out += a * d * (2 * hq + 2 * kv_heads) + 4 * hq  # flash: q, k, v, out (= o_proj input), lse
        if c > 1:
            out += a * d * hq  # the head->sequence all-to-all output is a separate o_proj input
        return out

    def mlp_block(self, moe: bool) -> float:
        st, a = self.stats, self.a
        if moe:
            # Routed tokens (top_k per token) through the grouped experts: gathered input, gate/up,
            # act and product; plus fp32 router logits and probabilities.
            inter = st.moe_intermediate // self.expert_tp
            return st.top_k * (a * st.hidden + 4 * a * inter) + 8 * st.num_experts
        if self.tiled_mlp_shards > 1:
            return 0.0  # only the (already counted) input is kept; chunks are recomputed in backward
        return 4 * a * st.intermediate / self.tp  # gate out, act(gate), up out, product

    def lora(self, spec: LayerSpec) -> float:
        if not self.lora_rank:
            return 0.0
        targets = {p.lora_target for p in spec.params if p.lora_target in self.lora_targets}
        return self.a * self.lora_rank * len(targets)  # x @ A, saved by the B matmul

    def layer_saved(self, spec: LayerSpec, checkpointed: bool) -> float:
        """Bytes per token a decoder layer keeps from forward until its backward."""
        if checkpointed:
            return self.a * self.stats.hidden / self.s  # only the layer input
        h = self.stats.hidden
        return 2 * self.norm(h) + self.attention_block() + self.mlp_block(spec.moe) + self.lora(spec)

    def layer_backward_work(self, spec: LayerSpec, checkpointed: bool) -> float:
        """Transient bytes per token while one layer runs backward: its recomputed activations (if
        checkpointed), activation gradients of the MLP and of the hidden state."""
        st, a = self.stats, self.a
        recompute = self.layer_saved(spec, False) if checkpointed else 0.0
        inter = st.top_k * st.moe_intermediate / self.expert_tp if spec.moe else st.intermediate / self.tp
        mlp_grads = 4 * a * inter / (self.tiled_mlp_shards if not spec.moe else 1)
        if self.tiled_mlp_shards > 1 and not spec.moe:
            mlp_grads += 4 * a * inter / self.tiled_mlp_shards  # one recomputed chunk
        return recompute + mlp_grads + 2 * a * st.hidden

    def rope(self) -> float:
        return 2 * self.a * self.stats.head_dim  # cos and sin, shared by all layers

    def head_saved(self) -> float:
        return self.norm(self.stats.hidden)  # final norm (its output is lm_head's saved input)

    def logits_peak(self) -> float:
        """Working set of the loss at the start of backward (fp32, per token).

        No TP: log_softmax output (saved), the gradient from nll_loss and log_softmax's
        gradient output: 3 x 4 V. TP (vocab_parallel_logprobs): saved shifted logits,
        softmax, -softmax*g, one-hot, one-hot*g and their sum: 6 x 4 V / t."""
        v = self.stats.vocab
        return 12 * v if self.tp == 1 else 24 * v / self.tp
