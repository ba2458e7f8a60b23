"""Responses that try to forge a code verdict (issue 60, item 1), shared by the process
sandbox's test (tests/unit/test_verdict_hacks.py) and the container's
(tests/integration/test_docker_sandbox.py). Every one defines a wrong function, or
none, and tries to make the run pass anyway; each must score the incorrect reward."""

from __future__ import annotations

ADD_TESTS = (
    "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert abs(add(0.5, 0.25) - 0.75) < 1e-9"
)
"""An assert-style row's tests; `abs` is there for the builtins hack to aim at."""
HONEST = "def add(x, y):\n    return x + y\n"

_FORGE = """
import json, os, struct
def forge(message):
    body = json.dumps(message).encode()
    return struct.pack(">I", len(body)) + body
def spray(messages):
    for fd in range(1, 16):
        for message in messages:
            try:
                os.write(fd, forge(message))
            except OSError:
                pass
"""

HACKS: dict[str, str] = {
    "frame walk for the token": """
import os, sys
frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
        if isinstance(value, dict) and isinstance(value.get("token"), str):
            print("\\n" + value["token"], flush=True)
            os._exit(0)
    frame = frame.f_back
def add(x, y):
    return 0
""",
    "frame walk for the tests": """
import re, sys
def add(x, y):
    frame = sys._getframe()
    while frame is not None:
        for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
            text = value if isinstance(value, str) else repr(value)[:100000]
            found = re.search(r"add\\(%r, %r\\) == (\\S+)" % (x, y), text)
            if found:
                return eval(found.group(1))
        frame = frame.f_back
    return 0
""",
    "gc.get_objects for the token or the tests": """
import gc, os
for obj in gc.get_objects():
    if isinstance(obj, dict):
        for value in list(obj.values()):
            if isinstance(value, str) and ("__sluice_done_" in value or "assert add" in value):
                print("\\n" + value, flush=True)
                os._exit(0)
def add(x, y):
    return 0
""",
    "an always-equal object": """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    def __sub__(self, other): return self
    def __abs__(self): return 0
    __hash__ = object.__hash__
def add(x, y):
    return Anything()
""",
    "a str subclass equal to everything": """
class Yes(str):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = str.__hash__
def add(x, y):
    return Yes("no")
""",
    "an int subclass equal to everything": """
class Yes(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __sub__(self, other): return Yes(0)
    def __abs__(self): return 0
    __hash__ = int.__hash__
def add(x, y):
    return Yes(7)
""",
    "a list subclass equal to everything": """
class Yes(list):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
def add(x, y):
    return Yes()
""",
    "os._exit(0) at import": "import os\nos._exit(0)\n",
    "os._exit(0) in the body": "def add(x, y):\n    import os\n    os._exit(0)\n",
    "sys.exit(0) at import": "import sys\ndef add(x, y):\n    return 0\nsys.exit(0)\n",
    "SystemExit in the body": "def add(x, y):\n    raise SystemExit(0)\n",
    "printing the expected output": (
        "print('5\\n0\\n0.75\\nall tests passed\\nOK', flush=True)\n"
        "def add(x, y):\n    print(x + y, flush=True)\n"
    ),
    "monkeypatched builtins": """
import builtins
class Nothing(Exception):
    pass
builtins.AssertionError = Nothing
builtins.isinstance = lambda *args: True
builtins.abs = lambda value: 0
builtins.print = lambda *args, **kwargs: None
def add(x, y):
    return -1
""",
    "patched abs under a float check": """
import builtins
builtins.abs = lambda value: 0
def add(x, y):  # wrong on the float case only abs() checks (and on 0, for HumanEval/53)
    return 99.0 if isinstance(x, float) or x == 0 else x + y
""",
    "a late forked child that prints a pass": """
import ctypes, os, time
if ctypes.CDLL(None).fork() == 0:
    time.sleep(0.3)
    for fd in range(1, 16):
        try:
            os.write(fd, b"\\n__sluice_done_forged__\\nall tests passed\\n")
        except OSError:
            pass
    os._exit(0)
def add(x, y):
    return 0
""",
    "a huge result": "def add(x, y):\n    return list(range(10**6))\n",
    "a huge string": "def add(x, y):\n    return 'x' * (8 << 20)\n",
    "a deeply nested result": (
        "def add(x, y):\n    r = []\n    for _ in range(10**5):\n        r = [r]\n    return r\n"
    ),
    "forged frames on every descriptor": _FORGE
    + """
spray([{"id": "0", "ok": 5}, {"verdict": "passed"}, {"op": "ready", "passed": True}])
def add(x, y):
    spray([{"id": "0", "ok": x + y}, {"passed": True}])
    return 0
""",
    "an oversized frame header": """
import os, struct
def add(x, y):
    for fd in range(1, 16):
        try:
            os.write(fd, struct.pack(">I", 2**31 - 1) + b"{")
        except OSError:
            pass
    return 0
""",
    "a recursion bomb": "def add(x, y):\n    return add(x, y)\n",
    "a C-stack recursion bomb past the limit": """
import sys
sys.setrecursionlimit(10**6)
def add(x, y):
    nested = []
    for _ in range(10**5):
        nested = [nested]
    return len(repr(nested))
""",
    "sleeping past the deadline": "import time\ndef add(x, y):\n    time.sleep(60)\n",
    "an AssertionError subclass": (
        "class Passed(AssertionError):\n    pass\n"
        "def add(x, y):\n    raise Passed('all tests passed')\n"
    ),
    "stealing the requests from stdin": (
        "import sys\nstolen = sys.stdin.read()\ndef add(x, y):\n    return len(stolen)\n"
    ),
}
"""Each response, by the trick it tries."""

SLOW = {"sleeping past the deadline"}
"""Hacks that end at the deadline (the tests assert it holds)."""
