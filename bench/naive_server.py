"""A naive ADS server, the baseline pilotfish is compared with.

What a straightforward Python control plane looks like: sync grpcio (``grpc.server`` with a
``ThreadPoolExecutor``; each open stream parks a worker thread, plus a reader thread of its own),
and every response built and serialized for the stream it goes to: a ``DiscoveryResponse``
message with each resource packed into an ``Any`` (serialized) and the whole response serialized
again by grpc, per stream, per push. Nothing is shared between streams.

It serves the same content as pilotfish: the snapshot file is read with pilotfish's parser and
builders (so the resources are identical), and versions are content hashes per type. Its SotW
logic is the textbook one: ignore stale nonces; answer a request whose version or names differ
from what the stream has; on a change, push each subscribed type whose version changed, in ADS
order (CDS, EDS, LDS, RDS). The file is polled for changes every 20 ms (no debounce).

It writes the two events the benchmarks read, in pilotfish's event-log format:
``server_started`` (``xds``) and ``snapshot_loaded`` (``versions``).

``python -m bench.naive_server --snapshot FILE --xds 127.0.0.1:0 --event-log FILE``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2

from pilotfish.build.desired import build_snapshot, merge_states
from pilotfish.sources import load_desired

_ORDER = (
    "type.googleapis.com/envoy.config.cluster.v3.Cluster",
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
    "type.googleapis.com/envoy.config.listener.v3.Listener",
    "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
)
_WILDCARD = set(_ORDER[0:1] + _ORDER[2:3])
_CHANGED = object()


class Store:
    """The current resources (messages) and version per type; tells every stream of a change."""

    def __init__(self, path: Path, events: Any) -> None:
        self.path = path
        self.events = events
        self.lock = threading.Lock()
        self.resources: dict[str, dict[str, Any]] = {}
        self.versions: dict[str, str] = {}
        self.streams: set[queue.Queue[Any]] = set()
        self.mtime = 0.0

    def load(self) -> None:
        snapshot = build_snapshot(merge_states({"file": load_desired(self.path)}), str(self.path))
        resources, versions = {}, {}
        for url in _ORDER:
            ts = snapshot.get(url)
            messages = {name: r.message for name, r in ts.resources.items()} if ts else {}
            digest = hashlib.sha256()
            for name in sorted(messages):
                digest.update(messages[name].SerializeToString(deterministic=True))
            resources[url] = messages
            versions[url] = digest.hexdigest()[:16]
        with self.lock:
            self.resources, self.versions = resources, versions
            streams = list(self.streams)
        self.events("snapshot_loaded", versions=_short(versions))
        for q in streams:
            q.put(_CHANGED)

    def poll_forever(self) -> None:
        while True:
            time.sleep(0.02)
            try:
                mtime = os.stat(self.path).st_mtime_ns
            except FileNotFoundError:
                continue
            if mtime != self.mtime:
                self.mtime = mtime
                try:
                    self.load()
                except Exception as exc:
                    print(f"naive server: cannot load {self.path}: {exc}", file=sys.stderr)


def _short(versions: dict[str, str]) -> dict[str, str]:
    names = {
        "Cluster": "CDS",
        "ClusterLoadAssignment": "EDS",
        "Listener": "LDS",
        "RouteConfiguration": "RDS",
        "Secret": "SDS",
    }
    return {names[url.rsplit(".", 1)[-1]]: v for url, v in versions.items()}


class Ads:
    """StreamAggregatedResources, one thread (plus a reader thread) per stream."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def stream(self, requests: Any, context: grpc.ServicerContext) -> Any:
        inbox: queue.Queue[Any] = queue.Queue()

        def read() -> None:
            try:
                for request in requests:
                    inbox.put(request)
            except Exception:
                pass
            inbox.put(None)

        with self.store.lock:
            self.store.streams.add(inbox)
        threading.Thread(target=read, daemon=True).start()
        nonces = 0
        sent: dict[str, tuple[str, str, frozenset[str]]] = {}  # type -> (nonce, version, names)
        subscribed: dict[str, list[str]] = {}
        try:
            while True:
                item = inbox.get()
                if item is None:
                    return
                if item is _CHANGED:
                    due = [url for url in _ORDER if url in subscribed]
                else:
                    url = item.type_url
                    if not url:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "type_url is required")
                    last = sent.get(url)
                    if item.response_nonce and (last is None or item.response_nonce != last[0]):
                        continue  # stale
                    subscribed[url] = list(item.resource_names)
                    due = [url]
                for url in due:
                    with self.store.lock:
                        version = self.store.versions.get(url, "")
                        by_name = self.store.resources.get(url, {})
                    names = subscribed[url]
                    wildcard = url in _WILDCARD and (not names or "*" in names)
                    chosen = sorted(by_name) if wildcard else sorted(n for n in names if n in by_name)
                    last = sent.get(url)
                    have = last[1] if last else (item.version_info if item is not _CHANGED else "")
                    if last is not None and last[1] == version and last[2] == frozenset(chosen):
                        continue
                    if last is None and have == version:
                        continue
                    nonces += 1
                    response = discovery_pb2.DiscoveryResponse(version_info=version, type_url=url, nonce=str(nonces))
                    for name in chosen:
                        packed = any_pb2.Any()
                        packed.Pack(by_name[name])
                        response.resources.append(packed)
                    sent[url] = (str(nonces), version, frozenset(chosen))
                    yield response
        finally:
            with self.store.lock:
                self.store.streams.discard(inbox)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.naive_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--snapshot", type=Path, required=True)
    parser.add_argument("--xds", default="127.0.0.1:0")
    parser.add_argument("--event-log", type=Path, required=True)
    parser.add_argument("--max-workers", type=int, default=4000, help="worker threads (one per open stream)")
    args = parser.parse_args(argv)
    log = open(args.event_log, "a", encoding="utf-8")  # noqa: SIM115
    log_lock = threading.Lock()

    def emit(event: str, **fields: Any) -> None:
        line = json.dumps({"ts": round(time.time(), 6), "event": event, **fields}, separators=(",", ":"))
        with log_lock:
            log.write(line + "\n")
            log.flush()

    store = Store(args.snapshot, emit)
    store.mtime = os.stat(args.snapshot).st_mtime_ns
    store.load()
    ads = Ads(store)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=args.max_workers),
        maximum_concurrent_rpcs=None,
        options=[("grpc.max_send_message_length", 512 * 1024 * 1024)],
    )
    handler = grpc.method_handlers_generic_handler(
        "envoy.service.discovery.v3.AggregatedDiscoveryService",
        {
            "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
                ads.stream,
                request_deserializer=discovery_pb2.DiscoveryRequest.FromString,
                response_serializer=discovery_pb2.DiscoveryResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port(args.xds)
    server.start()
    host = args.xds.rsplit(":", 1)[0]
    emit("server_started", xds=f"{host}:{port}", registry=None)
    threading.Thread(target=store.poll_forever, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(1).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
