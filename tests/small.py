"""The smallest real GPT the runtime tests train (GQA, SwiGLU, RMSNorm, RoPE), and its plan."""

SMALL_GPT = dict(name="small", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=64,
                 activation="swiglu", norm="rmsnorm", position_embedding="rope")
SMALL_PLAN = "micro_batch_size=8,global_batch_size=16,seq_len=32"
