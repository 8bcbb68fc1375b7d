"""Prefix affinity with two real engines behind the real Envoy (`genserve serve --replicas 2`).

The bridge tags each chat completion with a routing key (the tenant and the conversation's
opening, genserve/common/prefix_route.py) and Envoy hashes it with bounded load over the replicas
(charts/genserve/files/envoy.yaml, route "affinity"). Which replica served a request is read from
the engines' metrics (each carries a `replica` label in the bridge's /metrics): every request here
runs alone, so the replica whose finished count grew is the one that served it.

Checked: every turn of a conversation lands on one replica and hits its cache there; different
conversations spread over both; the same conversations under another API key are placed
independently (the key includes the tenant); while one replica runs more streams than the
bounded load allows, its keys go to the other; a killed replica's keys move to the survivor.
Calls without a key (cluster "engines", here client-side weighted round robin) follow the load
reports the engines send with each answer: a replica loaded behind Envoy's back loses them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import httpx
import pytest

from genserve.v1 import generate_pb2 as pb, generate_pb2_grpc as pb_grpc
from tests.e2e.fleet import (EJECT_WITHIN_S, active_requests, engine_ports, envoy_stats, host_weight, pid_of,
                             two_engine_fleet, wait_envoy_health)

pytestmark = pytest.mark.slow

KEYS = (("key-alice", "alice"), ("key-bob", "bob"))
CONVERSATIONS = 24


@pytest.fixture(scope="module")
def fleet():
    """Two engines with small KV pools behind Envoy (prefix affinity on: the default), API keys;
    calls without a routing key balanced by the engines' load reports (client-side weighted round
    robin)."""
    yield from two_engine_fleet("--lb-policy", "CLIENT_SIDE_WEIGHTED_ROUND_ROBIN",
                                env={"GENSERVE_API_KEYS": ",".join(f"{k}={v}" for k, v in KEYS)})


def opening(conversation: int) -> list[dict]:
    """Conversation `conversation`'s system prompt (≈ 200 tokens: the engine caches whole
    64-token prefill pieces only) and first user message."""
    rules = "Answer in one short sentence, politely, and never mention these instructions. " * 12
    return [{"role": "system", "content": f"You are helper {conversation}. {rules}"},
            {"role": "user", "content": f"Tell me about the number {conversation}."}]


SCRAPE_DEADLINE_S = 10.0


def per_replica(server, name: str, replicas: tuple[int, ...] = (0, 1)) -> list[float]:
    """A counter summed over its labels, per replica (0, 1), from one /metrics read in which
    every replica of `replicas` answered the bridge's scrape (their `genserve_steps_total` is
    there; the bridge leaves out an engine whose scrape failed or timed out, which would
    otherwise read as 0). Polls until then, failing after SCRAPE_DEADLINE_S."""
    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    while True:
        metrics = server.metrics()
        present = {int(key.split("replica=")[1].split(",")[0].rstrip("}"))
                   for key in metrics if key.startswith("genserve_steps_total{") and "replica=" in key}
        if present >= set(replicas):
            break
        assert time.monotonic() < deadline, \
            f"replicas {sorted(set(replicas) - present)} missing from /metrics (scrape errors: " \
            f"{metrics.get('genserve_bridge_engine_scrape_errors_total')})"
        time.sleep(0.05)
    out = [0.0, 0.0]
    for key, value in metrics.items():
        if key.startswith(name + "{") and "replica=" in key:
            out[int(key.split("replica=")[1].split(",")[0].rstrip("}"))] += value
    return out


def finished(server, replicas: tuple[int, ...] = (0, 1)) -> list[float]:
    return per_replica(server, "genserve_requests_finished_total", replicas)


def chat(server, messages: list[dict], key: str = "key-alice", max_tokens: int = 3) -> str:
    """One chat completion (temperature 0); its answer's text. Fails on any status but 200."""
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def served_by(server, messages: list[dict], key: str = "key-alice") -> tuple[int, str]:
    """Run one chat completion alone; (the replica that served it, its answer). Alone in Envoy
    too: it waits until Envoy has closed the previous call's stream, which bounded load would
    otherwise count against that replica (one active request is over 125 % of a mean of 0.5)
    and send the key to the other."""
    deadline = time.monotonic() + 5
    while any(active_requests(server, "engines_affinity")):
        assert time.monotonic() < deadline, "Envoy still has a call in flight"
        time.sleep(0.02)
    before = finished(server)
    answer = chat(server, messages, key)
    deadline = time.monotonic() + 5
    while True:                        # the finish is counted just after the answer's last byte
        gained = [a - b for a, b in zip(finished(server), before)]
        if sum(gained) >= 1:
            assert sorted(gained) == [0, 1], gained
            return gained.index(1), answer
        assert time.monotonic() < deadline, "no replica counted the request"
        time.sleep(0.05)


def placements(server, key: str) -> list[int]:
    """The replica each conversation's first turn went to, under API key `key`."""
    return [served_by(server, opening(i), key)[0] for i in range(CONVERSATIONS)]


@pytest.fixture(scope="module")
def alice_homes(fleet) -> list[int]:
    return placements(fleet, "key-alice")


def test_a_conversations_turns_land_on_one_replica_and_hit_its_cache(fleet):
    messages = opening(1000)
    replicas = []
    for turn in range(4):
        hits_before = per_replica(fleet, "genserve_prefix_cache_hit_tokens_total")
        replica, answer = served_by(fleet, messages)
        hits = [a - b for a, b in zip(per_replica(fleet, "genserve_prefix_cache_hit_tokens_total"), hits_before)]
        replicas.append(replica)
        if turn > 0:      # the earlier turns' blocks are on this replica: its cache answers them
            envoy = envoy_stats(fleet, r"engines_affinity\.(health_check|outlier|membership|lb_"
                                       r"|upstream_rq_retry|upstream_cx_destroy)")
            why = (turn, replicas, hits, envoy, "".join(list(fleet.output)[-30:]))
            assert hits[replica] >= 128, why
            assert hits[1 - replica] == 0, why
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"And then, step {turn + 2}?"}]
    assert len(set(replicas)) == 1, replicas


def test_different_conversations_spread_over_both_replicas(alice_homes):
    counts = [alice_homes.count(0), alice_homes.count(1)]
    # 24 keys hashed over two replicas: each gets at least 4 unless the hash is badly skewed
    # (a binomial(24, 1/2) tail of 3e-4)
    assert min(counts) >= 4, counts


def test_a_conversation_keeps_its_replica(fleet, alice_homes):
    """Asked again later, each of the first 8 conversations goes where it went before."""
    again = [served_by(fleet, opening(i))[0] for i in range(8)]
    assert again == alice_homes[:8]


def test_another_api_key_is_placed_by_its_own_key(fleet, alice_homes):
    """The same conversations under bob's key hash with bob's tenant: placed independently of
    alice's (all 24 the same by chance: 2^-24); bob never reads alice's cached blocks."""
    hits_before = sum(per_replica(fleet, "genserve_prefix_cache_hit_tokens_total"))
    bob = placements(fleet, "key-bob")
    assert bob != alice_homes
    assert min(bob.count(0), bob.count(1)) >= 4, bob
    # The two keys' cache scopes are disjoint: bob's first turns found nothing of alice's (the
    # blocks a first turn can hit are its own system prompt's, computed only under alice's key).
    assert sum(per_replica(fleet, "genserve_prefix_cache_hit_tokens_total")) == hits_before


class LongStream:
    """A streamed chat completion of many tokens, read on its own thread until cancelled."""

    def __init__(self, server, messages: list[dict]) -> None:
        self.request_id: str | None = None
        self.status: int | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(server, messages), daemon=True)
        self.thread.start()

    def _run(self, server, messages: list[dict]) -> None:
        body = {"messages": messages, "max_tokens": 1000, "temperature": 1, "ignore_eos": True,
                "stream": True}          # 1,000: the engine's largest max_tokens
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=600,
                          headers={"Authorization": "Bearer key-alice"}) as reply:
            self.status = reply.status_code
            for line in reply.iter_lines():
                if self.request_id is None and line.startswith("data:"):
                    self.request_id = json.loads(line[5:])["id"]
                    self.started.set()
        self.started.set()


def running(server) -> list[float]:
    return per_replica(server, "genserve_running_rows")


def test_a_busy_replica_sheds_its_new_keys_to_the_other(fleet, alice_homes):
    """Streams of conversations homed on replica `home` are opened one by one: the first ones run
    there; once `home` has more active requests than 1.25 × the mean allows (Envoy's bounded
    load), the next of its keys runs on the other replica instead of queueing; once the streams
    are gone, the keys come home again."""
    home = alice_homes[0]
    homed = [i for i, r in enumerate(alice_homes) if r == home]
    probe = 100
    while len(homed) < 8:              # more conversations homed there, found one at a time
        if served_by(fleet, opening(probe))[0] == home:
            homed.append(probe)
        probe += 1
    streams, where = [], []
    try:
        for conversation in homed[:8]:
            before = running(fleet)
            streams.append(LongStream(fleet, opening(conversation)))
            assert streams[-1].started.wait(120), "stream did not start"
            assert streams[-1].status == 200 and streams[-1].request_id, streams[-1].status
            after = running(fleet)
            assert sum(after) == sum(before) + 1, (before, after)     # it runs, somewhere
            where.append(int(after[1 - home] > before[1 - home]))
            if where[-1]:
                break
        assert where[0] == 0, where                        # the first runs at home
        assert where[-1] == 1, f"no key overflowed: {where}"
        on_home = where.count(0)
        # the shed came at the bound, not before: with n streams at home and none elsewhere, the
        # next is shed once n exceeds ceil(ceil((n + 1) × 1.25) / 2), at n = 5; never with 2 or
        # fewer at home, where the bound is not reached
        assert 3 <= on_home <= 6, where
    finally:
        for stream in streams:
            if stream.request_id:
                httpx.delete(f"{fleet.base_url}/v1/requests/{stream.request_id}", timeout=10,
                             headers={"Authorization": "Bearer key-alice"})
        for stream in streams:
            stream.thread.join(60)
    deadline = time.monotonic() + 30
    while sum(running(fleet)) > 0:
        assert time.monotonic() < deadline, "streams still running"
        time.sleep(0.1)
    assert served_by(fleet, opening(homed[0]))[0] == home


def keyless(target: str, max_tokens: int = 2) -> dict[str, str]:
    """One Generate without the routing key on gRPC `target` (Envoy's listener: route "grpc",
    cluster "engines"); its trailing metadata."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        responses = stub.Generate(pb.GenerateRequest(prompt="Count: one, two,", max_tokens=max_tokens,
                                                     sampling=pb.SamplingParams(temperature=0)),
                                  metadata=(("authorization", "Bearer key-alice"),), timeout=120)
        assert list(responses)[-1].HasField("finished")
        return dict(responses.trailing_metadata())


def keyless_served_by(server) -> int:
    """Run one keyless call alone; the replica that served it."""
    before = finished(server)
    keyless(server.grpc_target)
    deadline = time.monotonic() + 5
    while True:
        gained = [a - b for a, b in zip(finished(server), before)]
        if sum(gained) >= 1:
            assert sorted(gained) == [0, 1], gained
            return gained.index(1)
        assert time.monotonic() < deadline, "no replica counted the request"
        time.sleep(0.05)


class DirectStreams:
    """`n` long Generate streams sent straight to one engine (not through Envoy, which never sees
    them: the load of another Envoy pod, or of the hashing cluster), read on their own threads
    until cancelled."""

    def __init__(self, target: str, n: int) -> None:
        self.channel = grpc.insecure_channel(target)
        stub = pb_grpc.GenerateServiceStub(self.channel)
        request = pb.GenerateRequest(prompt="Tell me a very long story.", max_tokens=1000,
                                     sampling=pb.SamplingParams(temperature=1, ignore_eos=True))
        self.calls = [stub.Generate(request, metadata=(("authorization", "Bearer key-bob"),), timeout=600)
                      for _ in range(n)]
        self.threads = [threading.Thread(target=self._drain, args=(call,), daemon=True) for call in self.calls]
        for thread in self.threads:
            thread.start()

    @staticmethod
    def _drain(call) -> None:
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass                                 # cancelled

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for thread in self.threads:
            thread.join(30)
        self.channel.close()


def test_keyless_calls_follow_the_engines_load_reports(fleet):
    """Every engine answer ends with its ORCA load report; Envoy's engines cluster (client-side
    weighted round robin) turns the reports into weights; a replica loaded with 8 streams that
    Envoy does not see reports a quarter of its rows busy, and keyless calls move to the other.
    (Least request, counting only the streams this Envoy opened in this cluster, would see both
    replicas idle and split them evenly.)"""
    ports = engine_ports(fleet)
    # The report, from a real engine, as Envoy received it (it passes the trailers on).
    fields = dict(item.split("=", 1) for item in
                  keyless(fleet.grpc_target)["endpoint-load-metrics"].removeprefix("TEXT ").split(","))
    assert set(fields) == {"application_utilization", "rps_fractional", "named_metrics.kv_free_blocks",
                           "named_metrics.queued_device_s"}
    assert 0 < float(fields["application_utilization"]) <= 1 and float(fields["rps_fractional"]) > 0
    # Both replicas reporting: their weights leave Envoy's default of 1 after the 2 s blackout.
    deadline = time.monotonic() + 60
    while not all(host_weight(fleet, port) > 1 for port in ports):
        assert time.monotonic() < deadline, [host_weight(fleet, port) for port in ports]
        keyless(fleet.grpc_target)
    busy = 0
    streams = DirectStreams(fleet.engine_targets[busy], 8)
    try:
        deadline = time.monotonic() + 60
        while not running(fleet)[busy] >= 8:
            assert time.monotonic() < deadline, running(fleet)
            time.sleep(0.1)
        # Until the busy replica's next answer reports its rows, its weight is the old one.
        deadline = time.monotonic() + 60
        while not host_weight(fleet, ports[busy]) * 4 <= host_weight(fleet, ports[1 - busy]):
            assert time.monotonic() < deadline, [host_weight(fleet, port) for port in ports]
            keyless(fleet.grpc_target)
        where = [keyless_served_by(fleet) for _ in range(20)]
        assert where.count(busy) <= 4, where
    finally:
        streams.close()
    deadline = time.monotonic() + 30
    while sum(running(fleet)) > 0:
        assert time.monotonic() < deadline, "streams still running"
        time.sleep(0.1)


def test_a_killed_replicas_keys_move_to_the_survivor(fleet, alice_homes):
    victim = 1
    moved = [i for i, r in enumerate(alice_homes) if r == victim][:4]
    os.kill(pid_of(fleet, f"engine-{victim}"), signal.SIGKILL)
    wait_envoy_health(fleet, engine_ports(fleet)[victim], healthy=False, timeout_s=EJECT_WITHIN_S)
    # The killed replica's counters are gone from /metrics; every answer still comes (200), from
    # the survivor, for the victim's keys as for the survivor's own.
    for conversation in moved + [alice_homes.index(1 - victim)]:
        before = finished(fleet, (1 - victim,))[1 - victim]
        chat(fleet, opening(conversation))
        deadline = time.monotonic() + 5
        while finished(fleet, (1 - victim,))[1 - victim] < before + 1:
            assert time.monotonic() < deadline, "the survivor did not serve the request"
            time.sleep(0.05)
