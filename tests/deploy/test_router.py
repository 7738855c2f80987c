"""Routing across data-parallel replicas: a prompt goes where its prefix was computed, unless that replica is
too busy; a replica that is down gets nothing; round-robin takes turns."""

import pytest

from llmpipe.deploy.router import NoReplicaError, PrefixAffinityRouter, RoundRobinRouter, prefix_hashes
from llmpipe.engine.block_manager import BlockManager
from llmpipe.kv_cache.kinds import FullAttentionSpec

BLOCK = 4


def test_prefix_hashes_are_the_engines_own_block_hashes():
    tokens = list(range(30))
    seq = type("Seq", (), {"block_hashes": [], "all_token_ids": tokens, "cache_salt": None})()
    manager = BlockManager(8, BLOCK, [FullAttentionSpec()])
    assert prefix_hashes(tokens, BLOCK) == manager._hashes(seq, len(tokens) // BLOCK)


def test_a_conversation_returns_to_the_replica_that_holds_its_prefix():
    router = PrefixAffinityRouter(BLOCK, slack=2)
    system_a, system_b = list(range(100, 120)), list(range(200, 220))
    first_a = router.choose(system_a + [1, 2, 3, 4], [0, 0])
    first_b = router.choose(system_b + [5, 6, 7, 8], [1, 0] if first_a == 0 else [0, 1])
    assert first_a != first_b  # a new prefix goes to the least-loaded replica
    for turn in range(5):  # each turn resends the conversation: longer, same beginning
        assert router.choose(system_a + [1, 2, 3, 4] + list(range(turn * 8)), [1, 1]) == first_a
        assert router.choose(system_b + [5, 6, 7, 8] + list(range(turn * 8)), [1, 1]) == first_b


def test_a_busy_preferred_replica_yields_to_the_least_loaded():
    router = PrefixAffinityRouter(BLOCK, slack=2)
    prompt = list(range(40))
    assert router.choose(prompt, [0, 0]) == 0
    assert router.choose(prompt, [2, 0]) == 0  # within the slack
    assert router.choose(prompt, [3, 0]) == 1  # past it
    assert router.choose(prompt, [1, 1]) == 1  # the prefix now lives where it was last computed


def test_replicas_that_are_down_get_nothing_and_forgetting_clears_affinity():
    router = PrefixAffinityRouter(BLOCK)
    prompt = list(range(40))
    assert router.choose(prompt, [0, 5]) == 0
    assert router.choose(prompt, [None, 5]) == 1
    router.forget(1)
    assert router.remembered[1] == 0
    assert router.choose(prompt, [0, 0]) == 0  # nobody holds it, nor anything else: the first
    with pytest.raises(NoReplicaError, match="no engine replica is up"):
        router.choose(prompt, [None, None])


def test_round_robin_takes_turns_among_the_replicas_that_are_up():
    router = RoundRobinRouter()
    assert [router.choose([1], [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert [router.choose([1], [0, None, 0]) for _ in range(3)] == [2, 0, 2]


def test_the_affinity_table_is_bounded_and_fits_the_replicas_caches():
    router = PrefixAffinityRouter(BLOCK, capacity=30)
    for start in range(0, 400, 40):
        router.choose(list(range(start, start + 40)), [0, 0])
    assert len(router.owners) == 30
    assert sorted(router.remembered.values()) == [10, 20]  # the last three prompts, 10 blocks each
    router.fit(15)  # the replicas reported their caches: 15 blocks in all
    assert len(router.owners) == 15 and sum(router.remembered.values()) == 15
    assert list(router.owners)[-10:] == prefix_hashes(list(range(360, 400)), BLOCK)  # the oldest went first


def test_new_conversations_fill_the_replica_that_remembers_fewer_blocks():
    """Equal loads: a new prefix goes where fewer recent blocks live (SGLang's smallest tree), not by index."""
    router = PrefixAffinityRouter(BLOCK)
    long_chat, short_chat = list(range(1000, 1400)), list(range(2000, 2040))
    assert router.choose(long_chat, [0, 0]) == 0
    assert router.choose(short_chat, [0, 0]) == 1
    assert router.choose(list(range(3000, 3040)), [0, 0]) == 1  # 10 blocks on 1 against 100 on 0
    assert router.choose(list(range(4000, 4040)), [0, 5]) == 0  # replica 1 past the slack (5 > 0 + 4)
    assert router.choose(list(range(5000, 5040)), [4, 0]) == 1  # within the slack, fewer blocks still wins
    assert router.choose(list(range(6000, 6040)), [5, 0]) == 1  # past it: the least loaded


def test_a_shared_opening_too_short_to_matter_does_not_bind_a_request():
    """Prompts that share only their first block (an app's short system prompt) spread over the
    replicas; a prompt whose held prefix is at least min_match of its blocks stays with its holder."""
    router = PrefixAffinityRouter(BLOCK, min_match=0.5)
    shared = [7, 7, 7, 7]
    first = router.choose(shared + list(range(100, 136)), [0, 0])
    second = router.choose(shared + list(range(200, 236)), [0, 0])
    assert first != second  # 1 of 10 blocks held: placed by remembered blocks instead
    assert router.choose(shared + list(range(100, 136)) + list(range(900, 936)), [0, 0]) == first  # 10 of 19


def test_without_ray_data_parallel_serving_is_one_clear_error(tiny_path, monkeypatch, capsys):
    from llmpipe.cli import main

    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # `import ray` raises ImportError
    assert main(["serve", "--model", tiny_path, "--data-parallel-size", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "llmpipe: error: --data-parallel-size > 1 runs the replicas on Ray Serve: pip install 'llmpipe[ray]'"


def test_replicas_this_machine_cannot_place_are_refused_in_one_line():
    """Every replica asks Ray for --num-threads CPUs; a local Ray would wait for missing ones forever."""
    from argparse import Namespace

    from llmpipe.deploy.ray import cpu_shortfall

    assert cpu_shortfall(2, Namespace(data_parallel_size=2, num_threads=1)) is None
    assert cpu_shortfall(4, Namespace(data_parallel_size=2, num_threads=None)) is None  # one thread each
    message = cpu_shortfall(2, Namespace(data_parallel_size=4, num_threads=1))
    assert message.startswith("--data-parallel-size 4 x --num-threads 1 needs 4 CPUs, and Ray has 2 here")
    assert "\n" not in message
