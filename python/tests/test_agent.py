"""The agent client, faultline.init and faultline.admin."""

import os
import unittest

import faultline
import faultline.admin
from faultline import _agent

from helpers import FakeAgent


class AgentTest(unittest.TestCase):
    def setUp(self):
        self.agent = FakeAgent()
        os.environ["FAULTLINE_AGENT"] = self.agent.sock
        faultline._reset()

    def tearDown(self):
        os.environ.pop("FAULTLINE_AGENT", None)
        faultline._reset()
        self.agent.close()

    def test_one_connection_reopened_once_when_broken(self):
        c = _agent.client()
        self.assertIs(_agent.client(), c)
        c.call({"op": "groups", "groups": {}})
        sock = c._sock
        c.call({"op": "groups", "groups": {}})
        self.assertIs(c._sock, sock)
        # The agent hangs up after the next request: the call reconnects
        # once and gets its answer on the new connection.
        hung = []

        def hang_up_once(req, conn):
            if not hung:
                hung.append(req)
                return None
            return {"ok": True}

        self.agent.handlers["saved"] = hang_up_once
        c.call({"op": "saved", "step": 1, "persist": False})
        self.assertIsNot(c._sock, sock)
        self.assertEqual(len(hung), 1)

    def test_refusals_name_the_op_and_the_reason(self):
        with self.assertRaises(faultline.AgentError) as cm:
            _agent.client().call({"op": "nonsense"})
        self.assertIn("op nonsense", str(cm.exception))
        self.assertIn("unknown op", str(cm.exception))

    def test_unreachable_agent(self):
        os.environ["FAULTLINE_AGENT"] = os.path.join(self.agent.dir, "gone")
        faultline._reset()
        with self.assertRaises(faultline.AgentError) as cm:
            faultline.init()
        self.assertIn("FAULTLINE_AGENT=", str(cm.exception))
        self.assertIn("gone", str(cm.exception))

    def test_timeout(self):
        import threading
        release = threading.Event()
        self.agent.handlers["wait"] = lambda req, conn: (release.wait(5), {
            "ok": True})[1]
        with self.assertRaises(faultline.AgentError) as cm:
            _agent.client().call({"op": "wait", "step": 1, "timeout_s": 0},
                                 timeout=0.2)
        self.assertIn("no answer within 0.2 s", str(cm.exception))
        release.set()
        self.assertTrue(_agent.client().call({"op": "groups"})["ok"])

    def test_init_says_hello_once(self):
        self.agent.hello["resume_step"] = 3
        os.environ["RANK"] = "5"
        try:
            self.assertEqual(faultline.init(), 3)
            self.assertEqual(faultline.init(), 3)
        finally:
            del os.environ["RANK"]
        hello = [r for r in self.agent.requests if r["op"] == "hello"]
        self.assertEqual(hello, [{"op": "hello", "rank": 5,
                                  "pid": os.getpid()}])

    def test_bad_environment_names_the_variable(self):
        os.environ["RANK"] = "five"
        try:
            with self.assertRaises(ValueError) as cm:
                faultline.init()
            self.assertIn("RANK='five'", str(cm.exception))
        finally:
            del os.environ["RANK"]

    def test_admin(self):
        self.assertEqual(faultline.admin.members(), {"what": "members"})
        self.assertEqual(faultline.admin.switch_status(), {"what": "switch"})
        self.assertEqual(faultline.admin.faults(), {"what": "faults"})
        self.assertEqual(faultline.admin.orchestrations(),
                         {"what": "orchestrations"})
        self.agent.handlers["admin"] = lambda req, conn: {
            "ok": True, "result": '[{"rank": 0}]'}
        self.assertEqual(faultline.admin.members(), [{"rank": 0}])

    def test_admin_without_agent(self):
        del os.environ["FAULTLINE_AGENT"]
        with self.assertRaises(RuntimeError) as cm:
            faultline.admin.faults()
        self.assertIn("FAULTLINE_AGENT", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
