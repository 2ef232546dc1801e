"""Warm spares: handed a rank, a spare runs it as python would."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

import faultline

from helpers import FakeAgent, make_ring

# The folder the faultline under test was imported from.
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(
    faultline.__file__)))
SPARE = ["-c", "import faultline.spare as s; s.main()"]

SCRIPT = """
import json, os, sys
import faultline
from faultline import _agent, _ring
out = {"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
       "name": __name__, "torch": "torch" in sys.modules,
       "env": {k: os.environ.get(k)
               for k in ("RANK", "GONE", "FAULTLINE_SPARE")},
       "ring": _ring._producer is not None and _ring._producer.path,
       "agent": _agent.client().path}
with open(os.environ["OUT"], "w") as f:
    json.dump(out, f)
if len(sys.argv) > 1 and sys.argv[1] == "raise":
    raise KeyError("from the script")
if len(sys.argv) > 1 and sys.argv[1] == "exit":
    sys.exit(7)
"""


class SpareTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="faultline-spare-")
        self.agent = FakeAgent()
        self.answers = {}
        self.agent.handlers["spare"] = lambda req, conn: self.answers[
            req["local_rank"]]
        os.makedirs(os.path.join(self.dir, "work", "pkg"))
        with open(os.path.join(self.dir, "work", "train.py"), "w") as f:
            f.write(textwrap.dedent(SCRIPT))
        with open(os.path.join(self.dir, "work", "pkg", "__init__.py"), "w"):
            pass
        with open(os.path.join(self.dir, "work", "pkg", "main.py"), "w") as f:
            f.write(textwrap.dedent(SCRIPT))
        # A torch that cannot be imported keeps most spares quick.
        os.makedirs(os.path.join(self.dir, "notorch", "torch"))
        with open(os.path.join(self.dir, "notorch", "torch", "__init__.py"),
                  "w") as f:
            f.write("raise ImportError('no torch in this test')\n")

    def tearDown(self):
        self.agent.close()
        shutil.rmtree(self.dir)

    def spare(self, local_rank, answer, torch=False):
        """Starts a spare for local_rank, to be answered with answer."""
        if answer is not None:
            self.answers[local_rank] = answer
        path = [PACKAGE] if torch else [os.path.join(self.dir, "notorch"),
                                        PACKAGE]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path),
                   FAULTLINE_AGENT=self.agent.sock, FAULTLINE_SPARE="1",
                   LOCAL_RANK=str(local_rank), GONE="here",
                   PYTHONDONTWRITEBYTECODE="1")
        env.pop("FAULTLINE_RING", None)
        return subprocess.Popen([sys.executable] + SPARE, env=env,
                                cwd=self.dir, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def out(self, n):
        with open(os.path.join(self.dir, f"out-{n}")) as f:
            return json.load(f)

    def answer(self, n, argv, module=False, **env):
        ring = make_ring(os.path.join(self.dir, f"ring-{n}"))
        e = {"RANK": str(n), "OUT": os.path.join(self.dir, f"out-{n}"),
             "GONE": None, "FAULTLINE_SPARE": None, "FAULTLINE_RING": ring}
        e.update(env)
        return {"ok": True, "env": e, "argv": argv, "module": module,
                "cwd": os.path.join(self.dir, "work")}

    def test_spares(self):
        work = os.path.join(self.dir, "work")
        procs = {
            0: self.spare(0, self.answer(0, ["train.py", "a", "b"]),
                          torch=True),
            1: self.spare(1, self.answer(1, ["pkg.main", "x"], module=True)),
            2: self.spare(2, self.answer(2, ["train.py", "raise"])),
            3: self.spare(3, self.answer(3, ["train.py", "exit"])),
        }
        codes = {n: p.wait(timeout=120) for n, p in procs.items()}
        errs = {n: p.stderr.read() for n, p in procs.items()}
        for p in procs.values():
            p.stdout.close()
            p.stderr.close()
        self.assertEqual(codes, {0: 0, 1: 0, 2: 1, 3: 7}, errs)

        o = self.out(0)
        self.assertEqual(o["argv"], ["train.py", "a", "b"])
        self.assertEqual(o["cwd"], work)
        self.assertEqual(o["path0"], work)
        self.assertEqual(o["name"], "__main__")
        self.assertTrue(o["torch"])
        self.assertEqual(o["env"], {"RANK": "0", "GONE": None,
                                    "FAULTLINE_SPARE": None})
        self.assertEqual(o["ring"], os.path.join(self.dir, "ring-0"))
        self.assertEqual(o["agent"], self.agent.sock)

        o = self.out(1)
        self.assertEqual(o["argv"], [os.path.join(work, "pkg", "main.py"),
                                     "x"])
        self.assertEqual(o["path0"], work)
        self.assertEqual(o["name"], "__main__")
        self.assertFalse(o["torch"])

        self.assertIn("Traceback (most recent call last)", errs[2])
        self.assertIn("KeyError: 'from the script'", errs[2])
        self.assertIn("train.py", errs[2])
        self.assertNotIn("spare.py", errs[2])
        self.assertNotIn("runpy", errs[2])

        spares = [r for r in self.agent.requests if r["op"] == "spare"]
        self.assertEqual(sorted(r["local_rank"] for r in spares), [0, 1, 2, 3])
        self.assertTrue(all(r["pid"] == procs[r["local_rank"]].pid
                            for r in spares))

    def test_agent_gone_exits_zero(self):
        self.agent.handlers["spare"] = lambda req, conn: None  # hang up
        p = self.spare(5, None)
        self.assertEqual(p.wait(timeout=60), 0)
        p.stdout.close()
        p.stderr.close()
        os.environ.pop("FAULTLINE_AGENT", None)
        r = subprocess.run([sys.executable] + SPARE, capture_output=True,
                           text=True, env=dict(os.environ, PYTHONPATH=PACKAGE,
                                               FAULTLINE_AGENT="",
                                               PYTHONDONTWRITEBYTECODE="1"),
                           timeout=60)
        self.assertEqual(r.returncode, 1)
        self.assertIn("FAULTLINE_AGENT", r.stderr)


if __name__ == "__main__":
    unittest.main()
