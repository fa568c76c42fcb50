"""Tiny real Hugging Face causal LMs for the trainer tests (tests/test_train*.py): random weights,
float64, and RMSNorm computed in float64 (stock Qwen2RMSNorm rounds through float32 even in a
float64 model, which turns 1e-16 differences of summation order into ~1e-9)."""

from __future__ import annotations

import torch


def _rmsnorm_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def tiny_qwen2(vocab_size: int, *, seed: int = 0, attn: str = "sdpa", max_positions: int = 4096):
    """A 2-layer random ``Qwen2ForCausalLM`` in float64 with exact (float64) RMSNorm."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                      attn_implementation=attn, dtype=torch.float64)
    model = Qwen2ForCausalLM(cfg).to(torch.float64)
    for module in model.modules():
        if type(module).__name__ == "Qwen2RMSNorm":
            module.forward = _rmsnorm_float64.__get__(module)
    return model


def id_tokenizer(vocab_size: int):
    """A tokenizer whose token i is the string ``<i>`` (TRL's trainers need one for the pad token);
    it never tokenizes anything in these tests: the ledger's ids go in as they are."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<0>")))
    tok.pad_token, tok.eos_token, tok.unk_token = "<0>", "<1>", "<0>"
    return tok
