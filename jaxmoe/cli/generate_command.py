"""``jaxmoe generate``: continue a prompt with a run's model, to check it by eye.

    jaxmoe generate --checkpoint runs/tiny --prompt "def main(" --max-new-tokens 64
    jaxmoe generate --checkpoint runs/tiny --prompt "import " --temperature 0.8 --top-k 40
    jaxmoe generate --checkpoint runs/deepseek --prompt "def " --speculative mtp

reads the newest readable checkpoint of ``DIR`` (the ``--out`` of ``jaxmoe train``, or a
converted model's directory), tokenizes the prompt with the run's tokenizer
(:mod:`jaxmoe.generate.text`) and prints the continuation: greedy by default
(``--temperature 0``), sampled otherwise. It stops after ``--max-new-tokens``, at the
end-of-document token, or at ``model.seq_len`` positions. ``--speculative mtp`` drafts
with the model's multi-token prediction module (:mod:`jaxmoe.generate.speculative`):
the same greedy tokens, the drafts verified and accepted counted. A missing or unreadable
directory, a prompt longer than ``model.seq_len`` or a bad sampling value is one line
and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from jaxmoe.config import Config, ConfigError


def add_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--checkpoint", required=True, metavar="DIR", help="a run directory (jaxmoe train --out)"
    )
    command.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    command.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="at most N tokens (64)"
    )
    command.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0: greedy (the default)"
    )
    command.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="sample among the K likeliest (0: all)"
    )
    command.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="sample among the likeliest tokens of total probability P (1: all)",
    )
    command.add_argument("--seed", type=int, default=0, metavar="S", help="the sampling seed")
    command.add_argument(
        "--speculative",
        choices=("none", "mtp"),
        default="none",
        help="mtp: draft each next token with the model's multi-token prediction module and "
        "verify it with the model (greedy; the same tokens, and the drafts accepted counted)",
    )


def run(config: Config | None, args: argparse.Namespace) -> int:
    """Print the continuation (``config`` is unused: the checkpoint holds the run's)."""
    from jaxmoe.generate import Sampling

    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if not args.prompt:
        raise ConfigError("--prompt '': give some text to continue")
    if args.speculative == "mtp" and args.temperature > 0:
        raise ConfigError(
            f"--speculative mtp with --temperature {args.temperature}: speculative decoding "
            "is greedy here; drop --temperature"
        )

    from jaxmoe.generate import Decoder, load_run_model, run_codec

    loaded = load_run_model(args.checkpoint)
    model_config = loaded.config.model
    codec = run_codec(args.checkpoint, loaded.config)
    prompt = codec.encode(args.prompt)
    if not prompt:
        raise ConfigError(f"--prompt {args.prompt!r}: gives no tokens")
    if len(prompt) > model_config.seq_len:
        raise ConfigError(
            f"--prompt: {len(prompt)} tokens, longer than the model's model.seq_len="
            f"{model_config.seq_len}: shorten it"
        )
    if max(prompt) >= model_config.vocab_size:
        raise ConfigError(
            f"--prompt: token id {max(prompt)} of {codec.source} is beyond the model's "
            f"model.vocab_size={model_config.vocab_size}"
        )
    if args.speculative == "mtp":
        from jaxmoe.generate.speculative import speculate, why_not_speculative

        reason = why_not_speculative(loaded.model)
        if reason is not None:
            raise ConfigError(f"--speculative mtp: {reason}; use --speculative none")
        speculation = speculate(loaded.model, prompt, args.max_new_tokens, codec.stop_ids)
        continuation = speculation.tokens
    else:
        (continuation,) = Decoder(loaded.model).generate(
            [prompt], args.max_new_tokens, sampling, seed=args.seed, stop_ids=codec.stop_ids
        )
    print(codec.decode(continuation), flush=True)
    if args.speculative == "mtp":
        print(
            f"jaxmoe generate: speculative (mtp): {speculation.drafted} drafts, "
            f"{speculation.accepted} accepted ({speculation.acceptance:.0%})",
            file=sys.stderr,
        )
    room = model_config.seq_len - len(prompt)
    if len(continuation) == room < args.max_new_tokens:
        print(
            f"jaxmoe generate: stopped after {room} tokens, at model.seq_len="
            f"{model_config.seq_len} positions",
            file=sys.stderr,
        )
    return 0
