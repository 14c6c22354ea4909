"""Tiny random Hugging Face causal LMs, one per family, and what each exercises.

Built from configs (no downloads), dropout off, fp32. ``FAMILIES[name]`` gives the config
class, the model class and the keyword arguments of the tiny config; ``exercises`` says which
feature of sequence-parallel propagation the family is in the matrix for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

VOCAB, DIM, LAYERS, HEADS = 128, 64, 2, 4


@dataclass(frozen=True)
class Family:
    name: str
    config: str                 # transformers config class name
    model: str                  # transformers causal-LM class name
    kwargs: dict = field(default_factory=dict)
    exercises: str = ""
    train: bool = True          # built in training mode (False: eval, see OPT)
    attention_layers: int = 2   # layers with attention (the rest: LFM2's convolutions)
    halo: bool = False          # a convolution layer that may exchange a halo (halo_layers)

    @property
    def halo_layers(self) -> int:
        """Layers whose convolution exchanges a halo (one each way): LFM2's, whether
        transformers calls it as ``causal_conv1d_fn`` (the ``causal_conv1d`` mixer) or its
        torch fallback is traced as ops (``F.conv1d`` then a slice: the ``conv1d`` form of
        ``spdsl.propagate.convs``)."""
        return 1 if self.halo else 0


def _llama_like(**kw) -> dict:
    base = {"vocab_size": VOCAB, "hidden_size": DIM, "intermediate_size": 128,
                "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": 2,
                "max_position_embeddings": 256, "attention_dropout": 0.0}
    base.update(kw)
    return base


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("llama", "LlamaConfig", "LlamaForCausalLM", _llama_like(),
           "GQA (4 q / 2 kv heads, repeat_kv), RoPE, RMSNorm, SwiGLU"),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _llama_like(),
           "GQA, q/k/v biases (the key bias has a zero gradient)"),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", _llama_like(head_dim=16),
           "GQA, q/k RMSNorm per head before RoPE"),
    Family("mistral", "MistralConfig", "MistralForCausalLM", _llama_like(sliding_window=None),
           "GQA, Llama layout under another config"),
    Family("gemma", "GemmaConfig", "GemmaForCausalLM",
           _llama_like(num_key_value_heads=1, head_dim=16, hidden_activation="gelu_pytorch_tanh"),
           "MQA (1 kv head, replicated up to the degree), scaled embeddings, tied embeddings"),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM",
           _llama_like(resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0),
           "fused qkv projection split after the matmul, fused gate_up"),
    Family("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM",
           {"vocab_size": VOCAB, "hidden_size": DIM, "intermediate_size": 128,
                "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "rotary_pct": 0.5,
                "max_position_embeddings": 256, "use_parallel_residual": True, "attention_dropout": 0.0,
                "hidden_dropout": 0.0},
           "partial rotary (half the head dim), fused qkv, parallel attention/MLP residual"),
    Family("gpt2", "GPT2Config", "GPT2LMHeadModel",
           {"vocab_size": VOCAB, "n_embd": DIM, "n_layer": LAYERS, "n_head": HEADS, "n_positions": 256,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
           "learned absolute positions, fused qkv (Conv1D), LayerNorm, tied embeddings"),
    Family("falcon", "FalconConfig", "FalconForCausalLM",
           {"vocab_size": VOCAB, "hidden_size": DIM, "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS, "multi_query": True, "parallel_attn": True, "bias": False,
                "new_decoder_architecture": False, "alibi": False, "attention_dropout": 0.0,
                "hidden_dropout": 0.0, "max_position_embeddings": 256},
           "MQA with fused qkv, parallel attention/MLP block, RoPE"),
    Family("gptj", "GPTJConfig", "GPTJForCausalLM",
           {"vocab_size": VOCAB, "n_embd": DIM, "n_layer": LAYERS, "n_head": HEADS, "rotary_dim": 8,
                "n_positions": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
           "interleaved partial rotary (rotary_dim 8 of 16), parallel block"),
    Family("phi", "PhiConfig", "PhiForCausalLM",
           {"vocab_size": VOCAB, "hidden_size": DIM, "intermediate_size": 128,
                "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "partial_rotary_factor": 0.5,
                "max_position_embeddings": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attention_dropout": 0.0},
           "partial rotary, q/k/v biases, parallel attention/MLP block, LayerNorm"),
    Family("opt", "OPTConfig", "OPTForCausalLM",
           {"vocab_size": VOCAB, "hidden_size": DIM, "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS, "ffn_dim": 128, "max_position_embeddings": 256,
                "word_embed_proj_dim": DIM, "dropout": 0.0, "attention_dropout": 0.0,
                "layerdrop": 0.0},
           "learned positions from the attention mask's cumsum (a scan along the sequence), "
           "ReLU MLP; run in eval() mode here (one program): its training-mode layerdrop draw "
           "(torch.rand([]) < p, Python control flow on data) runs in segments, traced once "
           "per path of draws (tests/hf/test_opt_layerdrop.py)", train=False),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
           _llama_like(head_dim=16, hidden_activation="gelu_pytorch_tanh", sliding_window=8,
                       attn_logit_softcapping=0.05, final_logit_softcapping=30.0,
                       query_pre_attn_scalar=16),
           "scores capped as c * tanh(s / c) (eager: the mask kernel's cap; 0.05, so that "
           "it bites at these scales: the loss moves 4e-5 and attention gradients 40% without "
           "it), a sliding and a full layer, capped logits"),
    Family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
           _llama_like(head_dim=16, hidden_activation="gelu_pytorch_tanh", sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"],
                       query_pre_attn_scalar=16),
           "a sliding and a full layer, each with its own rotary table, built by iterating a "
           "set (an order that differs by rank: spdsl.propagate.order), q/k RMSNorm"),
    Family("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM",
           _llama_like(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                       qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                       n_routed_experts=4, first_k_dense_replace=2, moe_intermediate_size=32),
           "multi-head latent attention: q/k head dim 24, v 16; complex rotary (torch.polar); "
           "keys written into a new_empty by copy_ into two slices, which becomes the cat of "
           "the pieces (spdsl.propagate.fills: at the Ulysses floor, no gathered keys)"),
    Family("cohere", "CohereConfig", "CohereForCausalLM", _llama_like(use_qk_norm=False),
           "interleaved rotary (stack + flatten), LayerNorm, parallel block, logit scale"),
    Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", _llama_like(),
           "q/k RMSNorm over every head at once (before the head split), post-norms"),
    Family("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM",
           _llama_like(no_rope_layer_interval=2, pad_token_id=0),
           "no rotary on every second layer (NoPE)"),
    Family("bloom", "BloomConfig", "BloomForCausalLM",
           {"vocab_size": VOCAB, "hidden_size": DIM, "n_layer": LAYERS, "n_head": HEADS,
                "attention_dropout": 0.0, "hidden_dropout": 0.0},
           "ALiBi: baddbmm of a per-head, per-key bias with q and k^T on [B*H, S, D], the "
           "mask added after, float32 softmax (the baddbmm form: the bias cut to each rank's "
           "heads after the all-to-all); no position ids (a packed batch attends across "
           "documents, on one device as under SP)"),
    Family("gpt_bigcode", "GPTBigCodeConfig", "GPTBigCodeForCausalLM",
           {"vocab_size": VOCAB, "n_embd": DIM, "n_layer": LAYERS, "n_head": HEADS,
                "n_positions": 256, "multi_query": True, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0},
           "multi-query attention in one fused projection (q of every head, one k and v)"),
    # dense families of 2025-2026, in transformers 5.17 and later
    Family("glm4", "Glm4Config", "Glm4ForCausalLM", _llama_like(head_dim=16, pad_token_id=0),
           "rotary on interleaved pairs (cos/sin repeat_interleave), norms after attention and "
           "after the MLP besides before, fused gate_up, q/k/v biases"),
    Family("seed_oss", "SeedOssConfig", "SeedOssForCausalLM",
           _llama_like(head_dim=16, residual_dropout=0.0),
           "GQA with q/k/v biases, a dropout of its own after the attention output (off here, "
           "as every dropout of the matrix)"),
    Family("apertus", "ApertusConfig", "ApertusForCausalLM", _llama_like(),
           "xIELU activation with learned parameters, no gate, q/k RMSNorm per head"),
    Family("arcee", "ArceeConfig", "ArceeForCausalLM", _llama_like(),
           "squared-ReLU MLP without a gate"),
    Family("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", _llama_like(head_dim=16),
           "rotary on interleaved pairs, tied embeddings"),
    Family("hunyuan_v1_dense", "HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM",
           _llama_like(head_dim=16), "q/k RMSNorm per head after the rotary"),
    Family("olmo3", "Olmo3Config", "Olmo3ForCausalLM",
           _llama_like(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
           "a sliding and a full layer, q/k RMSNorm over every head at once"),
    Family("exaone4", "Exaone4Config", "Exaone4ForCausalLM",
           _llama_like(head_dim=16, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"]),
           "a sliding layer with rotary and a full layer without, q/k RMSNorm per head, "
           "norms after attention and MLP"),
    Family("lfm2", "Lfm2Config", "Lfm2ForCausalLM",
           _llama_like(layer_types=["conv", "full_attention"], block_ff_dim=128,
                       conv_L_cache=3),
           "a short causal convolution along the sequence in one layer (split, the previous "
           "rank's last 2 tokens exchanged, and their document indices given `seq_idx`: "
           "captured as causal_conv1d_fn), attention in the other",
           attention_layers=1, halo=True),
]}


# families in the tested matrix, and the attention implementations each supports (GPT-J has
# no SDPA path in transformers; BLOOM's attention is its own ops whatever the setting)
MATRIX = list(FAMILIES)
ATTN = {f: ("eager",) if f in ("gptj", "bloom") else ("sdpa", "eager") for f in FAMILIES}


def unsupported(name: str, attn: str, data: str = "plain") -> str:
    """Why the installed transformers builds no ``name`` model with ``attn`` or runs it on
    ``data`` ("" when it does): Gemma 2 lost its SDPA path in 5.23 (SDPA cannot cap scores),
    so its capped scores run through eager attention only there; from 5.2x, a ``seq_idx``
    reaching ``causal_conv1d_fn`` without the ``causal_conv1d`` kernel is an error (the torch
    fallback cannot keep documents apart), where 5.17's fallback ignores it."""
    import transformers
    cls = getattr(transformers, FAMILIES[name].model)
    if attn == "sdpa" and not getattr(cls, "_supports_sdpa", True):
        return f"transformers {transformers.__version__}: {cls.__name__} has no SDPA attention"
    if data == "packed_seq_idx" and not _conv_takes_seq_idx():
        return (f"transformers {transformers.__version__}: causal_conv1d_fn refuses seq_idx "
                "without the causal_conv1d kernel")
    return ""


def _conv_takes_seq_idx() -> bool:
    from transformers.models.lfm2 import modeling_lfm2
    try:
        modeling_lfm2.causal_conv1d_fn(torch.zeros(1, 1, 2), torch.zeros(1, 2),
                                       seq_idx=torch.zeros(1, 2, dtype=torch.int32))
    except ValueError:
        return False
    return True


def build(name: str, attn: str = "sdpa", seed: int = 0, **overrides) -> torch.nn.Module:
    """The tiny random model of family ``name`` with ``attn_implementation=attn``."""
    import transformers
    fam = FAMILIES[name]
    cfg = getattr(transformers, fam.config)(**{**fam.kwargs, **overrides})
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = getattr(transformers, fam.model)(cfg)
    # eval mode with every dropout at 0 computes the training loss and gradients
    return model.float().train(fam.train)


def batch(b: int = 2, s: int = 32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (b, s), generator=g)
    return ids, ids.clone()


def padded(b: int = 2, s: int = 32, side: str = "right", seed: int = 1):
    """ids, labels (-100 on padding) and a 2-D attention mask; row 0 has no padding, row 1
    a quarter of padding on ``side``."""
    ids, labels = batch(b, s, seed)
    mask = torch.ones(b, s, dtype=torch.long)
    n = s // 4 + 1
    if side == "right":
        mask[1, s - n:] = 0
    else:
        mask[1, :n] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = labels.masked_fill(mask == 0, -100)
    return ids, labels, mask


def packed(s: int = 32, docs: tuple[int, ...] = (5, 14, 13), seed: int = 1):
    """One row of several documents: ids, labels (-100 on each document's first token) and
    position ids restarting at 0 for each document."""
    assert sum(docs) == s
    ids, labels = batch(1, s, seed)
    pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    labels = labels.masked_fill(pos == 0, -100)
    return ids, labels, pos
