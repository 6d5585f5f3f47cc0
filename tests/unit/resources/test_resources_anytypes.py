"""Lazy resolution of ``@type`` names (pilotfish.resources.anytypes): the module defining a type
is imported on first use (not the whole Envoy API at start-up), nested messages included, and a name
that exists nowhere is returned, so that the snapshot file's problem can name it."""

from __future__ import annotations

import subprocess
import sys

from pilotfish.resources.anytypes import ensure_type, ensure_types_in

BUFFER = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
NOPE = "type.googleapis.com/envoy.extensions.filters.http.nope.v3.Nope"


def test_the_module_defining_a_type_is_imported_on_first_use() -> None:
    # In a fresh interpreter: this one may have imported the buffer filter already.
    code = (
        "import sys\n"
        "from pilotfish.resources.anytypes import ensure_type\n"
        "name = 'envoy.extensions.filters.http.buffer.v3.buffer_pb2'\n"
        "before = name in sys.modules\n"
        "print(before, ensure_type(sys.argv[1]), name in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, BUFFER], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True", "True"]


def test_every_type_in_a_document_is_resolved_and_unknown_ones_are_returned() -> None:
    document = {
        "listeners": [
            {
                "filter_chains": [
                    {
                        "filters": [
                            {
                                "typed_config": {
                                    "@type": HCM,
                                    "http_filters": [
                                        {"typed_config": {"@type": BUFFER}},
                                        {"typed_config": {"@type": NOPE}},
                                    ],
                                }
                            }
                        ]
                    }
                ]
            }
        ]
    }
    assert ensure_types_in(document) == ["type.googleapis.com/envoy.extensions.filters.http.nope.v3.Nope"]
    assert ensure_type("envoy.config.cluster.v3.Cluster.CommonLbConfig")  # a nested message, by its name alone
    assert not ensure_type("type.googleapis.com/not.a.Type")
