"""A raw grpcio ADS client for the end-to-end tests: a stream that sends what the test puts in
its queue and reads the server's responses as they come (a proxy that behaves exactly as told)."""

from __future__ import annotations

import queue

import grpc
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

__all__ = ["AdsClient", "endpoints_of"]


class AdsClient:
    """A grpcio ADS stream that sends what the test puts in its queue."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.requests: queue.Queue[discovery_pb2.DiscoveryRequest | None] = queue.Queue()
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)
        self.responses = stub.StreamAggregatedResources(iter(self.requests.get, None), timeout=60)

    def ask(self, request: discovery_pb2.DiscoveryRequest) -> discovery_pb2.DiscoveryResponse:
        """Send ``request`` and wait for the next response."""
        self.requests.put(request)
        response: discovery_pb2.DiscoveryResponse = next(self.responses)
        return response

    def close(self) -> None:
        self.requests.put(None)
        self.responses.cancel()
        self.channel.close()


def endpoints_of(response: discovery_pb2.DiscoveryResponse) -> dict[str, set[str]]:
    """Assignment name -> its ``host:port`` endpoints, of an EDS response."""
    out = {}
    for item in response.resources:
        assignment = endpoint_pb2.ClusterLoadAssignment()
        item.Unpack(assignment)
        out[assignment.cluster_name] = {
            f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}"
            for group in assignment.endpoints
            for e in group.lb_endpoints
        }
    return out
