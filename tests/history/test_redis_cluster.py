"""RedisHistoryStore on a real Redis Cluster: three masters started by the tests.

The store takes a ``redis.asyncio.RedisCluster`` as its client: every key of a
store shares one hash tag, so one slot, and its scripts run there. A cluster
client's pipelines refuse scripts, so the claim's and the peek's scripts bring
their rows themselves (``lua/claim_rows.lua``, ``lua/peek_rows.lua``). The nodes are this
machine's ``redis-server`` (the binary of the Redis the tests already use), on
free loopback ports, with nothing kept on disk but their cluster files in a
temporary directory.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from redis.asyncio import RedisCluster

from tests._redis_cluster import cli, free_ports, missing, redis_cluster
from tests._services import unavailable
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
)
from touba.history.redis import RedisHistoryStore
from touba.integrations.openai_agents import ToubaSession
from touba.providers import Observation
from touba.testing.store_conformance import CHECK_NAMES, check_store

pytestmark = pytest.mark.redis

NODES = 3
_cli = cli  # (other test modules import these two from here)
_free_ports = free_ports


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    """A three-master cluster on loopback; the ports of its nodes."""
    reason = missing()
    if reason is not None:
        unavailable(reason)
    with redis_cluster(tmp_path_factory.mktemp("redis-cluster"), NODES) as ports:
        yield ports


@pytest.fixture
async def client(cluster: list[int]) -> AsyncIterator[RedisCluster]:
    connection = RedisCluster(host="127.0.0.1", port=cluster[0])
    try:
        yield connection
    finally:
        await connection.aclose()


async def test_the_store_passes_the_conformance_suite_on_a_cluster(
    client: RedisCluster, request: pytest.FixtureRequest
) -> None:
    stores = iter(range(1_000_000))

    def make(**limits: Any) -> RedisHistoryStore:
        return RedisHistoryStore(
            client=client, prefix=f"{request.node.name}-{next(stores)}:", **limits
        )

    report = await check_store(make, limited_factory=make, expiring_factory=make)
    assert report.passed == CHECK_NAMES


async def test_decisions_and_session_operations_on_a_cluster(client: RedisCluster) -> None:
    store = RedisHistoryStore(client=client, prefix="decisions:")
    history = DecisionHistory(HistoryConfig(store=store, namespace="ns", max_messages=6))
    identity = ConversationIdentity("ns", "p", "m", "native", "run", "inv", "agent")
    observations: list[Observation] = []
    for n in range(8):
        call = CapabilityCall(f"c{n}", "lookup", {"n": n})

        async def generate(window: HistoryWindow, call: CapabilityCall = call) -> DecisionMessage:
            return DecisionMessage(calls=(call,))

        await history.step(identity, observations, generate)
        observations = [Observation(call.call_id, call.name, call.arguments, "ok", {"n": n})]
    record = await store.read(identity.key)
    assert record is not None
    assert record["stats"]["exchanges"] == 8
    usage = await store.usage()  # read on the node holding the store's slot
    assert usage.durability is not None
    assert usage.durability.startswith("no persistence")  # the nodes run without any

    session = ToubaSession("s", store=store, namespace="ns", max_messages=4)
    items: list[Any] = [
        {"type": "function_call", "call_id": f"f{n}", "name": "f", "arguments": "{}"}
        for n in range(3)
    ]
    outputs: list[Any] = [
        {"type": "function_call_output", "call_id": f"f{n}", "output": "ok"} for n in range(3)
    ]
    for item, output in zip(items, outputs, strict=True):
        await session.add_items([item, output])
    assert await session.get_items() == [items[1], outputs[1], items[2], outputs[2]]
    assert await session.pop_item() == outputs[2]
    assert await session.get_items() == [items[0], outputs[0], items[1], outputs[1]]


def _calls(ports: list[int], command: str) -> int:
    """How many ``command`` calls the nodes ran since their stats were reset."""
    total = 0
    for port in ports:
        for line in _cli("-p", str(port), "info", "commandstats").splitlines():
            if line.startswith(f"cmdstat_{command}:"):
                total += int(line.split("calls=")[1].split(",")[0])
    return total


async def test_a_wide_session_read_is_one_script_call_on_a_cluster(
    client: RedisCluster, cluster: list[int]
) -> None:
    """The peek's script brings the rows itself (a cluster client's pipelines refuse
    scripts): one EVALSHA, where a reservation would take two (claim, commit) and an
    LRANGE of its own."""
    store = RedisHistoryStore(client=client, prefix="wide:")
    session = ToubaSession("s", store=store, namespace="ns")
    items: list[Any] = [{"role": "user", "content": f"q{n}"} for n in range(40)]
    await session.add_items(items)
    for _ in range(2):  # the reads settle wider than OPTIMISTIC_READ exchanges
        assert await session.get_items() == items
    for port in cluster:
        _cli("-p", str(port), "config", "resetstat")
    assert await session.get_items() == items
    assert _calls(cluster, "evalsha") == 1  # (the LRANGEs it runs count as its own)
    await session.add_items([{"role": "user", "content": "q40"}])  # never left reserved
    assert (await session.get_items())[-1] == {"role": "user", "content": "q40"}


async def test_a_decision_on_a_silent_cluster_fails_within_the_deadline(
    cluster: list[int],
) -> None:
    """Each node behind a loopback proxy (tests/_netproxy.py; the client reaches the
    nodes the cluster announces through ``address_remap``): with every proxy
    black-holed, a decision on a ``RedisCluster`` client with no timeout of its own
    fails with the retryable ``DecisionHistoryStoreUnavailable`` within
    ``deadline_seconds`` + 1 s; once the network returns the next decision succeeds
    and every acknowledged one is stored."""
    from contextlib import ExitStack

    from tests._netproxy import net_proxy
    from touba.errors import DecisionHistoryStoreUnavailable

    deadline = 1.0
    with ExitStack() as stack:
        proxies = {port: stack.enter_context(net_proxy("127.0.0.1", port)) for port in cluster}

        def remap(address: tuple[str, int]) -> tuple[str, int]:
            return "127.0.0.1", proxies[address[1]].port

        first = proxies[cluster[0]].port
        client = RedisCluster(host="127.0.0.1", port=first, address_remap=remap)
        direct = RedisCluster(host="127.0.0.1", port=cluster[0])
        prefix = f"touba-test-deadline-cluster:{time.monotonic_ns()}:"
        identity = ConversationIdentity("ns", "openai", "m", "native", "r", "i", "a")
        try:
            store = RedisHistoryStore(client=client, prefix=prefix, deadline_seconds=deadline)
            history = DecisionHistory(HistoryConfig(store=store, namespace="ns"))

            async def decide(text: str) -> None:
                async def generate(window: HistoryWindow) -> DecisionMessage:
                    return DecisionMessage(text=text, final=True)

                await history.step(identity, [], generate)

            await decide("d0")
            for proxy in proxies.values():
                proxy.black_hole()
            started = time.monotonic()
            with pytest.raises(DecisionHistoryStoreUnavailable) as caught:
                await decide("lost")
            elapsed = time.monotonic() - started
            assert caught.value.retryable
            assert elapsed < deadline + 1.0, elapsed
            for proxy in proxies.values():
                proxy.restore()
            await decide("d1")
            reader = RedisHistoryStore(client=direct, prefix=prefix)
            saved = await reader.read(identity.key)
            assert saved is not None
            texts = [m["text"] for ex in saved["exchanges"] for m in ex if m.get("text")]
            assert texts == ["d0", "d1"]
            await reader.delete(identity.key)
        finally:
            await client.aclose()
            await direct.aclose()
