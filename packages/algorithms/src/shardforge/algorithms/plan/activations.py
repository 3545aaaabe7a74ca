"""Activation bytes per token: what autograd saves for backward, counted tensor by tensor.

Legend (all per token on this rank): h hidden, d head dim, q = H d and kv = Hkv d (query /
key-value widths), I MLP width, V vocab, a bytes of the compute dtype, t tp, s = t under
sequence parallelism (1 otherwise), c cp. The counts follow the HF Llama/Qwen3 decoder
layer code and shardforge's attention/loss paths; docs/planner.md derives each term.

Autograd keeps a tensor only for the gradient of an input that requires grad: under LoRA the
base weights are frozen, so a frozen matmul keeps no input (its adapter's A does), a frozen
norm weight keeps no normalised value, and nothing before the first adapter of layer 0 keeps
anything (the frozen embedding's output needs no gradient). ``live`` says whether a layer's
input requires grad.
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

    @property
    def base_trainable(self) -> bool:
        """Full fine-tuning; under LoRA every base weight (linears, norms, embedding, lm_head) is frozen."""
        return not self.lora_rank

    def targets(self, spec: LayerSpec) -> frozenset[str]:
        """The linear names of ``spec`` that get LoRA adapters (empty without LoRA)."""
        if not self.lora_rank:
            return frozenset()
        return frozenset(p.lora_target for p in spec.params if p.lora_target in self.lora_targets)

    def norm(self, width: int, *, live: bool = True, output_saved: bool = True) -> float:
        """RMSNorm over a sequence-sharded input + its output as the next matmul saves it.

        fp32 upcast of the input (4 w: the input itself when it is fp32) and 1/rms (4), saved for the
        input's gradient when the input requires grad (``live``); the normalised value before the weight
        (a w), saved only when the norm weight is trained (not under LoRA); all on this rank's sequence
        shard (/ s). The output is all-gathered under SP and saved whole (a w) by the following
        matmul when it needs its input (a trained weight or a LoRA A)."""
        local = (4 * width + 4 if live else 0) + (self.a * width if self.base_trainable else 0)
        return local / self.s + (self.a * width if output_saved else 0)

    def attention_block(self, spec: LayerSpec | None = None, live: bool = True) -> float:
        """q/k norms and attention; ``live``: the layer input requires grad."""
        st, a, t, c = self.stats, self.a, self.tp, self.cp
        targets = self.targets(spec) if spec is not None else frozenset()
        d = st.head_dim
        hq, hkv = st.num_heads // t, max(st.num_kv_heads // t, 1)
        live_q, live_k = live or "q_proj" in targets, live or "k_proj" in targets
        live_attn = live_q or live_k or live or "v_proj" in targets
        o_input = self.base_trainable or "o_proj" in targets  # o_proj keeps its input for a weight grad
        out = 0.0
        if st.qk_norm:  # q_norm / k_norm: fp32 upcast + 1/rms per head (+ normalised when the weight trains)
            per_head = (4 + (a if self.base_trainable else 0)) * d + 4
            out += per_head * (hq * live_q + hkv * live_k)
        if self.attention == "cpu":
            # Block-diagonal SDPA: gathered copies of q and (GQA-expanded) k, v, the output, logsumexp, the
            # gather index and the index that restores token order (int64 each); the reordered output is the
            # o_proj input.
            return out + (4 * a * d * hq + 4 * hq + 16) * live_attn + a * d * hq * o_input
        kv_heads = max(hkv, c) if c > 1 else hkv  # Ulysses repeats kv heads when fewer than cp
        if live_attn:
            out += a * d * (2 * hq + 2 * kv_heads) + 4 * hq  # flash: q, k, v, out (= o_proj input), lse
        elif o_input:
            out += a * d * hq  # nothing before needs a gradient: only o_proj's input is kept
        if c > 1 and o_input:
            out += a * d * hq  # the head->sequence all-to-all output is a separate o_proj input
        return out

    def mlp_block(self, moe: bool, spec: LayerSpec | None = None, live: bool = True) -> float:
        """The MLP's saved tensors; ``live``: its input requires grad."""
        st, a = self.stats, self.a
        if moe:
            # Routed tokens (top_k per token) through the grouped experts: gathered input, gate/up,
            # act and product; plus fp32 router logits and probabilities.
            inter = st.moe_intermediate // self.expert_tp
            return st.top_k * (a * st.hidden + 4 * a * inter) + 8 * st.num_experts
        if self.tiled_mlp_shards > 1:
            return 0.0  # only the (already counted) input is kept; chunks are recomputed in backward
        targets = self.targets(spec) if spec is not None else frozenset()
        live_gate, live_up = live or "gate_proj" in targets, live or "up_proj" in targets
        # gate out (saved by act), act(gate) and up out (saved by their product), the product (down's input)
        width = a * st.intermediate / self.tp
        return width * (live_gate + live_up + live_gate + self._product_saved(targets))

    def _product_saved(self, targets: frozenset[str]) -> bool:
        return self.base_trainable or "down_proj" in targets

    def lora(self, spec: LayerSpec) -> float:
        return self.a * self.lora_rank * len(self.targets(spec))  # x @ A, saved by the B matmul

    def layer_live_out(self, spec: LayerSpec, live: bool) -> bool:
        """Whether a layer's output requires grad (under LoRA the embedding output does not, so layer 0's
        input is not live; the first adapter makes everything after it live)."""
        return live or self.base_trainable or bool(self.targets(spec))

    def layer_saved(self, spec: LayerSpec, checkpointed: bool, live: bool = True) -> float:
        """Bytes per token a decoder layer keeps from forward until its backward."""
        h = self.stats.hidden
        if checkpointed:
            return self.a * h / self.s  # only the layer input (held by the checkpoint)
        targets = self.targets(spec)
        trained = self.base_trainable
        live_mid = live or bool(targets & {"q_proj", "k_proj", "v_proj", "o_proj"})  # after the attention
        mlp_in = trained or bool(targets & {"gate_proj", "up_proj"}) or (self.tiled_mlp_shards > 1 and live_mid)
        return (
            self.norm(h, live=live, output_saved=trained or bool(targets & {"q_proj", "k_proj", "v_proj"}))
            + self.attention_block(spec, live)
            + self.norm(h, live=live_mid, output_saved=mlp_in or spec.moe)
            + self.mlp_block(spec.moe, spec, live_mid)
            + self.lora(spec)
        )

    def layer_backward_work(self, spec: LayerSpec, checkpointed: bool, live: bool = True) -> float:
        """Transient bytes per token at the peak of one layer's backward, on top of the saved activations:
        its recomputed activations (if checkpointed), and the activation gradients of its MLP and hidden
        state.

        The dense MLP peaks in the backward of ``act(gate) * up``: the product has been freed by then
        (down_proj's backward ran), the gradients of the product, of act(gate) and of up exist (3 a I / t),
        and so does the gradient of the hidden state (a h). Under fp32 the recomputed first norm's input is
        the checkpointed layer input itself (counted once). Under LoRA the recomputed ``up_proj`` forward
        (base output, adapter output, scaled adapter, their sum, with gate and act(gate) alive) reaches the
        same 6 a I / t."""
        st, a = self.stats, self.a
        recompute = 0.0
        if checkpointed:
            recompute = self.layer_saved(spec, False, live)
            if a == 4 and live:
                recompute -= a * st.hidden / self.s
            if {"up_proj", "down_proj"} <= self.targets(spec):
                # The recomputed up_proj forward (see above) also has down_proj's scaled adapter gradient
                # alive: ``adapter * scaling``'s backward saves nothing, so it ran before the recomputation.
                recompute += a * st.hidden
        if spec.moe:
            return recompute + 4 * a * st.top_k * st.moe_intermediate / self.expert_tp + 2 * a * st.hidden
        inter = st.intermediate / self.tp
        if self.tiled_mlp_shards > 1:
            # one recomputed chunk and its gradients; the input gradient is accumulated whole
            return recompute + 8 * a * inter / self.tiled_mlp_shards + 2 * a * st.hidden
        targets = self.targets(spec)
        product = a * inter * self._product_saved(targets)
        live_mlp = live or bool(targets - {"down_proj"})
        return recompute - product + 3 * a * inter * live_mlp + a * st.hidden

    def rope(self) -> float:
        return 2 * self.a * self.stats.head_dim  # cos and sin, shared by all layers

    def head_saved(self) -> float:
        """The final norm: its output is lm_head's saved input (not kept when lm_head is frozen)."""
        return self.norm(self.stats.hidden, output_saved=self.base_trainable)

    def logits_peak(self) -> float:
        """Working set of the loss at the start of backward (fp32, per token).

        No TP: log_softmax output (saved), the gradient from nll_loss and log_softmax's
        gradient output: 3 x 4 V. TP (vocab_parallel_logprobs): saved shifted logits,
        softmax, -softmax*g, one-hot, one-hot*g and their sum: 6 x 4 V / t."""
        v = self.stats.vocab
        return 12 * v if self.tp == 1 else 24 * v / self.tp
