"""Named architectures for load_format="dummy": published configs, no weights."""
from __future__ import annotations

_QWEN25_COMMON = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rms_norm_eps=1e-6,
                      rope_theta=1000000.0, max_position_embeddings=32768, bos_token_id=151643,
                      eos_token_id=151645)

PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2),
    "qwen2.5-0.5b": dict(_QWEN25_COMMON, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25_COMMON, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25_COMMON, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       vocab_size=152064, tie_word_embeddings=False),
    # Qwen/Qwen3-0.6B's config.json: head_dim 128 with 16 heads over hidden 1024
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
                       attention_bias=False, use_sliding_window=False, max_window_layers=28,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False,
                      bos_token_id=128000, eos_token_id=128001),
}
