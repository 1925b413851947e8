"""A step that compiles in seconds, as ``jaxmoe train`` flags: one MoE layer, short
sequences, few tokens, 200 kB of text."""

SMALL = [
    *("--model.num_layers", "1", "--model.moe_every", "1", "--model.seq_len", "16"),
    *("--train.batch_size", "8", "--model.d_model", "32", "--model.d_ff", "64"),
    *("--model.num_heads", "2", "--data.max_bytes", "200000"),
]
