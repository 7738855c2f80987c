"""`llmpipe bench multiturn`: multi-turn chats against an OpenAI-compatible server, and what its
prefix cache makes of them.

--conversations chats of --turns turns each; every turn resends the whole conversation so far (a
system prompt of its own, the earlier user and assistant turns, a new user message) as one streamed
/v1/chat/completions of --max-tokens tokens (temperature 0, ignore_eos). At most --concurrency chats
run at once, each chat's turns one after another; or, with --interleave, every chat is open at once
and --concurrency caps the turns in flight (the traffic of many users who read and type between
turns: a server must keep every chat's prefix between its turns, which is where a cache shared by
several replicas fills). --shared-words opens every system prompt with the same instructions, as
one application's chats do. The text is synthetic and seeded: the same
arguments send the same requests. Measured: TTFT of the turns that could reuse a cached prefix
(turn 2 on), output tokens/s, failures, and the prefix-cache hit rate, Δ llmpipe:prefix_cache_hits /
Δ llmpipe:prefix_cache_queries over the run (summed over label sets: a data-parallel server has one
per replica). --compare URL2 runs the same chats against a second server and prints the ratios.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from types import SimpleNamespace

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from llmpipe.bench.report import write_json
from llmpipe.bench.serve import RequestResult, percentiles, send_request, served_model, summarize

PREFIX_METRICS = ("llmpipe:prefix_cache_queries", "llmpipe:prefix_cache_hits")
WORDS = (
    "the of and to in is that for it as with was on be by at this from or an which one all were are but not "
    "have had they you there can more if will some what when their time would about out up into them other "
    "than then these two may first any like now such only its over also new after very most made where "
    "through back much before good well way because each people year just those how work part system "
    "number world between state under place while water long day point great home small large during "
    "always order model token cache prefix block batch stream request server engine memory layer weight "
    "attention kernel thread replica router latency answer question reason detail example summary"
).split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def system_prompt(seed: int, conversation: int, words: int, shared_words: int = 0) -> str:
    """The conversation's own system prompt: it shares no 16-token block with another's, unless it
    opens with `shared_words` of instructions every conversation shares (an application's own)."""
    rng = random.Random(f"{seed}/{conversation}/system")
    own = f"You are assistant {conversation} of run {seed}. Keep this briefing in mind: {_text(rng, words)}"
    if not shared_words:
        return own
    return f"Instructions for every assistant of run {seed}: {_text(random.Random(f'{seed}/shared'), shared_words)} {own}"


def user_message(seed: int, conversation: int, turn: int, words: int) -> str:
    return _text(random.Random(f"{seed}/{conversation}/{turn}"), words)


def prefix_cache_counts(base_url: str, headers: dict) -> dict[str, float] | None:
    """{'queries': .., 'hits': ..} from /metrics, each summed over all its label sets (None: unreadable)."""
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/metrics", headers=headers, timeout=30)
        response.raise_for_status()
        return parse_prefix_cache(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def parse_prefix_cache(text: str) -> dict[str, float] | None:
    counts = {name: 0.0 for name in PREFIX_METRICS}
    seen = set()
    # By sample name, whatever family the parser files it under (a labelled NAME_total can come out
    # as a family of its own); NAME_created is a timestamp.
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in counts:
                counts[name] += sample.value
                seen.add(name)
    if seen != set(PREFIX_METRICS):
        return None
    return {"queries": counts[PREFIX_METRICS[0]], "hits": counts[PREFIX_METRICS[1]]}


class Chat:
    """One conversation: its messages so far and each turn's result."""

    def __init__(self, args, conversation: int):
        self.conversation, self.results = conversation, []
        system = system_prompt(args.seed, conversation, args.system_words, args.shared_words)
        self.messages = [{"role": "system", "content": system}]

    async def take_turn(self, client: httpx.AsyncClient, url: str, model: str, args, progress: tqdm) -> bool:
        """The next turn sent and answered; whether another follows. A failed turn ends the chat (the
        turns it leaves count as failures)."""
        turn = len(self.results)
        self.messages.append({"role": "user", "content": user_message(args.seed, self.conversation, turn, args.user_words)})
        body = {
            "model": model, "messages": self.messages, "max_tokens": args.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }
        result = await send_request(client, url, body)
        self.results.append(result)
        progress.update(1)
        if not result.ok:
            skipped = args.turns - turn - 1
            self.results += [RequestResult(error="not sent: an earlier turn of its conversation failed")
                             for _ in range(skipped)]
            progress.update(skipped)
            return False
        self.messages.append({"role": "assistant", "content": result.text})
        return len(self.results) < args.turns


async def back_to_back(chats: list[Chat], send, concurrency: int) -> None:
    """At most `concurrency` chats open at once, each one's turns back to back."""
    limit = asyncio.Semaphore(concurrency)

    async def one(chat: Chat) -> None:
        async with limit:
            while await send(chat):
                pass

    await asyncio.gather(*(one(chat) for chat in chats))


async def interleaved(chats: list[Chat], send, concurrency: int, seed: int) -> None:
    """Every chat open at once, `concurrency` turns in flight: after each turn a chat comes back once
    a seeded random number (0 to len(chats)) of other turns have been taken, as users read and type
    between turns, so the server keeps every chat's prefix between its turns."""
    rng, queue = random.Random(f"{seed}/returns"), asyncio.PriorityQueue()
    for index in range(len(chats)):
        queue.put_nowait((float(index), index))
    taken, open_chats = 0, len(chats)

    async def worker() -> None:
        nonlocal taken, open_chats
        while (index := (await queue.get())[1]) >= 0:
            more = await send(chats[index])
            taken += 1
            if more:
                queue.put_nowait((taken + rng.uniform(0, len(chats)), index))
            elif (open_chats := open_chats - 1) == 0:
                for _ in range(concurrency):
                    queue.put_nowait((math.inf, -1))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def run_workload(base_url: str, model: str, args) -> tuple[list[list[RequestResult]], float]:
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    chats = [Chat(args, c) for c in range(args.conversations)]
    limits = httpx.Limits(max_connections=args.concurrency)
    with tqdm(total=args.conversations * args.turns, desc=base_url, unit="req") as progress:
        async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=_headers(args)) as client:

            def send(chat: Chat):
                return chat.take_turn(client, url, model, args, progress)

            start = time.perf_counter()
            if args.interleave:
                await interleaved(chats, send, args.concurrency, args.seed)
            else:
                await back_to_back(chats, send, args.concurrency)
            return [chat.results for chat in chats], time.perf_counter() - start


def run_one(base_url: str, args) -> dict:
    """The workload against one server: serve.summarize's figures over every turn, TTFT by turn, and
    the prefix-cache hit rate over the run."""
    model = served_model(SimpleNamespace(base_url=base_url, api_key=args.api_key, model=args.model,
                                         wait_for_server=args.wait_for_server))
    before = prefix_cache_counts(base_url, _headers(args))
    chats, duration = asyncio.run(run_workload(base_url, model, args))
    after = prefix_cache_counts(base_url, _headers(args))
    by_turn = [[chat[t] for chat in chats if t < len(chat)] for t in range(args.turns)]
    later_ttft = [r.ttft for turn in by_turn[1:] for r in turn if r.ok]
    cache = None
    if before is not None and after is not None:
        queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
        cache = {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}
    return {
        "url": base_url,
        "model": model,
        **summarize([r for chat in chats for r in chat], duration),
        "ttft_turn2_on": percentiles(later_ttft),
        "ttft_by_turn": [percentiles([r.ttft for r in turn if r.ok]) for turn in by_turn],
        "prompt_tokens_by_turn": [
            sum(r.prompt_tokens for r in turn if r.ok) / max(1, sum(r.ok for r in turn)) for turn in by_turn
        ],
        "prefix_cache": cache,
    }


def hit_rate(run: dict) -> float | None:
    return (run["prefix_cache"] or {}).get("hit_rate")


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def compare(first: dict, second: dict) -> dict:
    """hit rate (1) / (2), and TTFT p50 of turns 2+ (2) / (1): both above 1 when the first server wins."""
    return {
        "hit_rate_ratio": _ratio(hit_rate(first), hit_rate(second)),
        "ttft_p50_ratio": _ratio(second["ttft_turn2_on"]["p50_ms"], first["ttft_turn2_on"]["p50_ms"]),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary(run: dict, args) -> str:
    cache = run["prefix_cache"]
    hits = "unknown (no prefix-cache counters at /metrics)" if cache is None else (
        f"{_fmt(cache['hit_rate'], '.1%')} ({cache['hits']:.0f} of {cache['queries']:.0f} prompt blocks)")
    ttft, first = run["ttft_turn2_on"], run["ttft_by_turn"][0]
    in_flight = "turns (interleaved)" if args.interleave else "conversations"
    return (
        f"{run['url']} ({run['model']}): {args.conversations} conversations x {args.turns} turns, "
        f"{args.concurrency} {in_flight} at a time: {run['completed']} turns done, {run['failed']} failed, in "
        f"{run['duration_s']:.1f} s; {run['output_throughput']:.1f} output tok/s; TTFT p50/p90 of turns 2+ "
        f"{_fmt(ttft['p50_ms'], '.0f')}/{_fmt(ttft['p90_ms'], '.0f')} ms (turn 1: p50 {_fmt(first['p50_ms'], '.0f')} ms); "
        f"prefix-cache hit rate {hits}."
        + (f" Errors: {'; '.join(run['errors'])}" if run["errors"] else "")
    )


def _headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def main(args) -> dict:
    runs = [run_one(url, args) for url in [args.url, *([args.compare] if args.compare else [])]]
    report: dict = {
        "config": {key: getattr(args, key) for key in (
            "url", "compare", "conversations", "turns", "concurrency", "interleave", "max_tokens", "shared_words",
            "system_words", "user_words", "seed")},
        "runs": runs,
    }
    for run in runs:
        print(summary(run, args))
    if len(runs) == 2:
        report["comparison"] = ratios = compare(*runs)
        print(f"hit rate {args.url} / {args.compare}: {_fmt(ratios['hit_rate_ratio'], '.2f')}x; "
              f"TTFT p50 (turns 2+) {args.compare} / {args.url}: {_fmt(ratios['ttft_p50_ratio'], '.2f')}x")
    print(f"wrote {write_json(args.out, report)}")
    return report
