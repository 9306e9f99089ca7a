"""The gateway and the router run without torch: importing their entry modules loads neither torch nor any of
the worker's modules (they tokenize through the text layer, `services.text`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PRINT_LOADED = "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] == 'gpu_worker')))"
_LOADED = "import importlib, json, sys; importlib.import_module(sys.argv[1]); " + _PRINT_LOADED


@pytest.mark.parametrize("module", ["gateway.app", "gateway.main", "router.service", "router.main"])
def test_an_entry_module_of_the_gateway_or_router_loads_no_torch_and_no_worker_module(module):
    done = subprocess.run([sys.executable, "-c", _LOADED, module], capture_output=True, text=True, check=True,
                          timeout=120)
    assert json.loads(done.stdout.splitlines()[-1]) == []


_COMMAND_LINE_READ = ("import json, sys; from services.launcher.cli import build_parser; "
                      "build_parser().parse_args(sys.argv[1:]); " + _PRINT_LOADED)


@pytest.mark.parametrize("command", [["gateway"], ["router"]])
def test_the_console_script_starting_the_gateway_or_router_loads_no_torch(command):
    """`tokenfleet up` starts each service as `tokenfleet <service>`: reading that command line imports no
    benchmark (they load torch) and nothing of the worker."""
    done = subprocess.run([sys.executable, "-c", _COMMAND_LINE_READ, *command], capture_output=True, text=True,
                          check=True, timeout=120)
    assert json.loads(done.stdout.splitlines()[-1]) == []
