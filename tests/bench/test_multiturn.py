"""`llmpipe bench multiturn` against a live server: every turn answered, the hit rate the server's
prefix cache reports for the later turns, the same chats sent twice with --compare, and failures
counted, not raised."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from llmpipe.bench.multiturn import (back_to_back, compare, interleaved, parse_prefix_cache, system_prompt,
                                     user_message)
from llmpipe.cli import main
from tests.server.utils import metric

CONVERSATIONS, TURNS, MAX_TOKENS = 2, 3, 4


def bench(url: str, tmp_path, *extra: str) -> dict:
    out = tmp_path / "multiturn.json"
    args = ["bench", "multiturn", "--url", url, "--conversations", str(CONVERSATIONS), "--turns", str(TURNS),
            "--max-tokens", str(MAX_TOKENS), "--concurrency", "2", "--system-words", "40", "--user-words", "8",
            "--out", str(out), *extra]
    assert main(args) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("order", [[], ["--interleave"]], ids=["back-to-back", "interleaved"])
def test_later_turns_hit_the_prefix_cache(url, tmp_path, capsys, order):
    generated = metric(url, "llmpipe:generation_tokens_total")
    report = bench(url, tmp_path, *order)
    assert metric(url, "llmpipe:generation_tokens_total") - generated == CONVERSATIONS * TURNS * MAX_TOKENS
    (run,) = report["runs"]
    assert report["config"]["conversations"] == CONVERSATIONS and "comparison" not in report
    assert report["config"]["interleave"] == bool(order)
    assert (run["completed"], run["failed"], run["errors"]) == (CONVERSATIONS * TURNS, 0, [])
    assert run["total_output_tokens"] == CONVERSATIONS * TURNS * MAX_TOKENS
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration_s"])
    assert len(run["ttft_by_turn"]) == TURNS and all(t["p50_ms"] > 0 for t in run["ttft_by_turn"])
    assert 0 < run["ttft_turn2_on"]["p50_ms"] <= run["ttft_turn2_on"]["p90_ms"]
    tokens = run["prompt_tokens_by_turn"]
    assert tokens == sorted(tokens) and tokens[0] > 3 * 16  # each turn resends the last, and more
    cache = run["prefix_cache"]
    assert cache["queries"] > 0 and 0 < cache["hit_rate"] <= 1
    assert cache["hit_rate"] == pytest.approx(cache["hits"] / cache["queries"])
    assert "prefix-cache hit rate" in capsys.readouterr().out


def test_compare_runs_the_same_chats_twice_and_divides(url, tmp_path, capsys):
    report = bench(url, tmp_path, "--compare", url)
    first, second = report["runs"]
    assert first["prompt_tokens_by_turn"] == second["prompt_tokens_by_turn"]  # seeded: the same requests
    assert first["failed"] == second["failed"] == 0
    ratios = report["comparison"]
    assert ratios["hit_rate_ratio"] == pytest.approx(first["prefix_cache"]["hit_rate"] / second["prefix_cache"]["hit_rate"])
    assert ratios["ttft_p50_ratio"] == pytest.approx(second["ttft_turn2_on"]["p50_ms"] / first["ttft_turn2_on"]["p50_ms"])
    assert "hit rate" in capsys.readouterr().out.splitlines()[-2]


def test_unreachable_server_counts_failures(tmp_path):
    report = bench("http://127.0.0.1:9", tmp_path, "--model", "m", "--timeout", "5")
    (run,) = report["runs"]
    assert (run["completed"], run["failed"]) == (0, CONVERSATIONS * TURNS)  # first turns fail, the rest are not sent
    assert run["prefix_cache"] is None and run["ttft_turn2_on"]["p50_ms"] is None
    assert compare(run, run) == {"hit_rate_ratio": None, "ttft_p50_ratio": None}


def test_prefix_cache_counters_sum_over_replicas():
    text = """# TYPE llmpipe:prefix_cache_queries counter
llmpipe:prefix_cache_queries_total{replica="0"} 30.0
llmpipe:prefix_cache_queries_total{replica="1"} 10.0
# TYPE llmpipe:prefix_cache_hits counter
llmpipe:prefix_cache_hits_total{replica="0"} 20.0
llmpipe:prefix_cache_hits_created{replica="0"} 1.7e9
llmpipe:prefix_cache_hits_total{replica="1"} 5.0
# TYPE llmpipe:num_requests_running gauge
llmpipe:num_requests_running{replica="0"} 3.0
"""
    assert parse_prefix_cache(text) == {"queries": 40.0, "hits": 25.0}
    assert parse_prefix_cache("# TYPE other counter\nother_total 1.0\n") is None


def test_messages_are_seeded_and_conversations_share_no_prefix():
    assert system_prompt(0, 1, 50) == system_prompt(0, 1, 50) != system_prompt(1, 1, 50)
    assert user_message(0, 1, 2, 10) == user_message(0, 1, 2, 10) != user_message(0, 1, 3, 10)
    a, b = system_prompt(0, 1, 50), system_prompt(0, 2, 50)
    assert a[:40] != b[:40] and len(a.split()) > 50


def test_shared_instructions_open_every_system_prompt_and_the_rest_stays_each_ones_own():
    a, b = system_prompt(0, 1, 50, shared_words=30), system_prompt(0, 2, 50, shared_words=30)
    opening = a[: a.index(" You are assistant")]
    assert b.startswith(opening) and len(opening.split()) > 30
    assert a[len(opening):] == " " + system_prompt(0, 1, 50) and b[len(opening):] == " " + system_prompt(0, 2, 50)
    assert not system_prompt(1, 1, 50, shared_words=30).startswith(opening)  # seeded by the run


def schedule(order, chats: int, turns: int, concurrency: int) -> tuple[list[int], int, int]:
    """The conversations in the order their turns were sent, the most turns in flight at once, and
    the most conversations open (begun, not finished) at once, under a fake server."""
    left, sent, in_flight, open_now = [turns] * chats, [], [0], set()
    peaks = {"in_flight": 0, "open": 0}

    async def send(chat) -> bool:
        c = chat.conversation
        sent.append(c)
        open_now.add(c)
        in_flight[0] += 1
        peaks["in_flight"], peaks["open"] = max(peaks["in_flight"], in_flight[0]), max(peaks["open"], len(open_now))
        await asyncio.sleep(0.001 * (1 + c % 3))
        in_flight[0] -= 1
        left[c] -= 1
        if not left[c]:
            open_now.discard(c)
        return left[c] > 0

    asyncio.run(order([SimpleNamespace(conversation=c) for c in range(chats)], send, concurrency))
    return sent, peaks["in_flight"], peaks["open"]


def test_interleaved_turns_keep_every_conversation_open():
    """Back to back, a conversation's turns run together and only `concurrency` are open; interleaved,
    the same turns are sent, no more at once, but conversations wait between their turns."""
    chats, turns, concurrency = 8, 3, 2
    sequential, in_flight, open_at_once = schedule(back_to_back, chats, turns, concurrency)
    assert sorted(sequential) == sorted(list(range(chats)) * turns)
    assert (in_flight, open_at_once) == (concurrency, concurrency)
    mixed, in_flight, open_at_once = schedule(lambda *a: interleaved(*a, seed=0), chats, turns, concurrency)
    assert sorted(mixed) == sorted(sequential)
    assert in_flight == concurrency and open_at_once >= chats - 1
