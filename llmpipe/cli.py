"""The `llmpipe` command: generate, chat, bench. Any llmpipe error is one readable line."""

from __future__ import annotations

import argparse
import logging
import sys

from llmpipe.engine_args import add_engine_args, add_sampling_args, engine_kwargs, sampling_params
from llmpipe.errors import LLMPipeError
from llmpipe.outputs import RequestMetrics


def print_timing(metrics: RequestMetrics | None, num_tokens: int) -> None:
    if metrics is None or metrics.ttft is None:
        return
    itl = metrics.mean_itl
    rate = metrics.decode_tokens_per_s
    print(
        f"\n[{num_tokens} tokens | TTFT {metrics.ttft * 1000:.0f} ms | "
        f"mean ITL {itl * 1000 if itl else 0:.1f} ms | {rate or 0:.1f} tokens/s]",
        file=sys.stderr,
    )


def stream_reply(llm, prompt, params) -> str:
    text = ""
    for delta in llm.stream(prompt, params):
        text += delta
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    out = llm.last_output
    print_timing(out.metrics if out else None, len(out.outputs[0].token_ids) if out else 0)
    return text


def cmd_generate(args: argparse.Namespace) -> None:
    from llmpipe.llm import LLM

    params = sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    tokenizer = llm.get_tokenizer()
    use_chat = args.chat if args.chat is not None else bool(tokenizer and tokenizer.chat_template)
    prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}]) if use_chat else args.prompt
    stream_reply(llm, prompt, params)


def cmd_chat(args: argparse.Namespace) -> None:
    from llmpipe.llm import LLM

    params = sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("llmpipe chat: type a message, /reset to start over, /exit or Ctrl-D to leave.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        reply = stream_reply(llm, llm.chat_prompt(messages), params)
        messages.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmpipe", description="LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", dest="chat", action="store_true", default=None, help="apply the chat template")
    gen.add_argument("--no-chat", dest="chat", action="store_false")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from llmpipe.bench.cli import add_bench_parser
    from llmpipe.eval.cli import add_eval_parser
    from llmpipe.quant.cli import add_quantize_parser
    from llmpipe.server.cli import add_serve_parser

    from llmpipe.diagnose.cli import add_diagnose_parser, add_memory_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    add_quantize_parser(sub)
    add_eval_parser(sub)
    add_diagnose_parser(sub)
    add_memory_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from llmpipe.distributed.parallel_state import torchrun_worker

    if torchrun_worker():  # ranks > 0 of a torchrun launch serve rank 0's engine, whatever the command
        from llmpipe.distributed.worker import torchrun_main

        return torchrun_main()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (LLMPipeError, ValueError) as err:
        print(f"llmpipe: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nllmpipe: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
