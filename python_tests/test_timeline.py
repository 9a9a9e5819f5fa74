"""The timeline's marks of PJRT calls (src/sync/timeline.rs): with
PJRT_CROSSHOST_TIMELINE=1 every call into the plugin is stamped at its entry
and its return under the function's name; without it nothing is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# A fresh process: the flag is read once, when the library loads. It makes
# one call that succeeds, one that fails (null args), and destroys the
# failure's error, then prints the marks.
CHILD = r"""
import ctypes, json, sys
import pjrt_ctypes as pc
api = pc.Api(sys.argv[1])
api.initialize()
err = api.raw_call("PJRT_Client_Devices", None)
assert err, "null args must fail"
api.destroy_error(err)
lib = ctypes.CDLL(sys.argv[1])
lib.pjrt_crosshost_timeline_json.restype = ctypes.c_void_p
lib.pjrt_crosshost_free_string.argtypes = [ctypes.c_void_p]
ptr = lib.pjrt_crosshost_timeline_json()
print(ctypes.string_at(ptr).decode())
lib.pjrt_crosshost_free_string(ptr)
"""


def marks(lib_path, timeline: str) -> list:
    env = dict(os.environ, PYTHONPATH=str(HERE), PJRT_CROSSHOST_TIMELINE=timeline)
    out = subprocess.run([sys.executable, "-c", CHILD, str(lib_path)], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_every_pjrt_call_is_marked_at_entry_and_return_under_its_name(lib_path):
    calls = [(point, name) for _ns, point, name, _thread in marks(lib_path, "1")
             if point in ("api_enter", "api_exit")]
    assert calls == [
        ("api_enter", "PJRT_Plugin_Initialize"), ("api_exit", "PJRT_Plugin_Initialize"),
        # A call that fails at its args check is still marked.
        ("api_enter", "PJRT_Client_Devices"), ("api_exit", "PJRT_Client_Devices"),
        ("api_enter", "PJRT_Error_Destroy"), ("api_exit", "PJRT_Error_Destroy"),
    ], calls


def test_without_the_flag_nothing_is_marked(lib_path):
    assert marks(lib_path, "0") == []
