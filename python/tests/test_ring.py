"""The dotting ring's producer: span, mark, step, comm_span and the
collective records, read back as the agent's consumer reads them."""

import json
import os
import shutil
import tempfile
import threading
import time
import unittest

import faultline
from faultline import _ring

from helpers import RingReader, make_ring

START, END, MARK = _ring.RANGE_START, _ring.RANGE_END, _ring.MARK


class RingTest(unittest.TestCase):
    capacity = 1 << 17
    switch = 0x1F

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="faultline-ring-")
        self.path = make_ring(os.path.join(self.dir, "ring"), self.capacity,
                              self.switch)
        _ring.attach(self.path)
        self.r = RingReader(self.path)

    def tearDown(self):
        _ring.detach()
        self.r.close()
        shutil.rmtree(self.dir)

    def set_switch(self, bits):
        self.r.set_word(24, bits)

    def test_span_writes_start_and_end_sharing_an_id(self):
        before = time.time_ns()
        with faultline.span("forward"):
            with faultline.span("dataloader"):
                pass
        after = time.time_ns()
        recs = self.r.read()
        self.assertEqual([(x["type"], x["name"]) for x in recs],
                         [(START, "dataloader"), (END, ""),
                          (START, "forward"), (END, "")])
        inner, outer = recs[0:2], recs[2:4]
        for s, e in (inner, outer):
            self.assertEqual(s["id"], e["id"])
            self.assertTrue(before <= s["time"] <= e["time"] <= after)
            self.assertEqual(s["tid"], threading.get_native_id())
            self.assertEqual(s["domain"], 0)
        self.assertLessEqual(outer[0]["time"], inner[0]["time"])
        self.assertGreaterEqual(outer[1]["time"], inner[1]["time"])
        self.assertEqual(len({x["id"] for x in recs}), 2)
        self.assertEqual(self.r.pid, os.getpid())

    def test_record_lengths_are_aligned(self):
        for name in ("a", "abcdefg", "abcdefgh", "abcdefghi", "é" * 5):
            with faultline.span(name):
                pass
        for x in self.r.read():
            self.assertEqual(x["len"] % 8, 0)
            if x["type"] == START:
                n = len(x["name"].encode())
                self.assertEqual(x["len"], 32 + (n + 7) // 8 * 8)

    def test_step_and_mark(self):
        with faultline.step(12):
            faultline.mark("save_checkpoint")
        with faultline.span("step 13"):
            pass
        recs = self.r.read()
        self.assertEqual([(x["type"], x["name"]) for x in recs],
                         [(MARK, "save_checkpoint"), (START, "step 12"),
                          (END, ""), (START, "step 13"), (END, "")])
        with self.assertRaises(ValueError):
            faultline.step(-1)
        with self.assertRaises(TypeError):
            faultline.step("3")

    def test_switch_off_writes_nothing(self):
        self.set_switch(0)
        with faultline.span("forward"), faultline.step(1):
            faultline.mark("dataloader")
        with faultline.comm_span("allreduce", "tp-0", 4, "float32"):
            pass
        self.assertEqual(self.r.read(), [])
        self.assertIs(faultline.span("forward"), _ring._OFF)

    def test_switch_by_domain(self):
        # MindCluster's rule: the default domain is on while any of its four
        # kinds is, the communication domain while its kind is.
        cases = ((_ring.FP, True, False), (_ring.STEP, True, False),
                 (_ring.COMMUNICATION_OPERATOR, False, True),
                 (0, False, False), (0x1F, True, True))
        for bits, default, comm in cases:
            self.set_switch(bits)
            for name in ("forward", "dataloader", "save_checkpoint", "step 1",
                         "my phase"):
                with faultline.span(name):
                    pass
            with faultline.step(2):
                pass
            faultline.mark("forward")
            with faultline.comm_span("allreduce", "tp-0"):
                pass
            recs = self.r.read()
            d = [x for x in recs if x["domain"] == 0]
            c = [x for x in recs if x["domain"] == 1]
            self.assertEqual(len(d), 13 if default else 0, bits)
            self.assertEqual(len(c), 2 if comm else 0, bits)

    def test_a_range_started_on_ends_after_switch_off(self):
        with faultline.span("forward"):
            self.set_switch(0)
        self.assertEqual([x["type"] for x in self.r.read()], [START, END])

    def test_communication_names(self):
        with faultline.span({"opName": "allreduce", "groupName": "dp",
                             "count": 8, "dataType": "float16"},
                            domain="communication"):
            pass
        with faultline.span('{"opName":"send","groupName":"pp"}',
                            domain="communication"):
            pass
        with faultline.comm_span("allgather", "tp-1", 3, "bfloat16"):
            pass
        recs = [x for x in self.r.read() if x["type"] == START]
        self.assertTrue(all(x["domain"] == 1 for x in recs))
        ops = [json.loads(x["name"]) for x in recs]
        self.assertEqual(ops[0], {"opName": "allreduce", "groupName": "dp",
                                  "count": "8", "dataType": "float16"})
        self.assertEqual(ops[1], {"opName": "send", "groupName": "pp"})
        self.assertEqual(ops[2], {"opName": "allgather", "groupName": "tp-1",
                                  "count": "3", "dataType": "bfloat16"})

    def test_plain_communication_name_is_refused_naming_the_keys(self):
        for bad in ("HcclAllReduce", '{"groupName": "dp"}', "[1]",
                    {"groupName": "dp"}, {"opName": "", "groupName": "dp"},
                    {"opName": "x", "groupName": "dp", "count": -1}):
            for fn in (faultline.span, faultline.mark):
                with self.assertRaises(ValueError) as cm:
                    fn(bad, domain="communication")
                msg = str(cm.exception)
                self.assertTrue("opName" in msg or "count" in msg, msg)
        with self.assertRaises(ValueError) as cm:
            faultline.span("HcclAllReduce", domain="communication")
        for key in ("opName", "groupName", "count", "dataType"):
            self.assertIn(key, str(cm.exception))
        # Refused whatever the switch says: never recorded and dropped later.
        self.set_switch(0)
        with self.assertRaises(ValueError):
            faultline.span("HcclAllReduce", domain="communication")
        with self.assertRaises(ValueError):
            faultline.span("forward", domain="other")
        with self.assertRaises(ValueError):
            faultline.comm_span("", "dp")

    def test_bad_names(self):
        for bad, err in ((3, TypeError), ("a\x00b", ValueError),
                         ("x" * (_ring.MAX_NAME + 1), ValueError),
                         ("\ud800", ValueError)):
            with self.assertRaises(err):
                faultline.span(bad)

    def test_wrap_around_pads_the_end(self):
        name = "x" * 100  # 136-byte start + 32-byte end per range
        ids = []
        for i in range(3 * self.capacity // 168):
            with faultline.span(name):
                pass
            recs = self.r.read(keep_padding=True)
            for x in recs:
                if x["type"] == 0:
                    ids.append("pad")
                elif x["type"] == START:
                    self.assertEqual(x["name"], name)
                    ids.append(x["id"])
        self.assertGreaterEqual(ids.count("pad"), 2)
        starts = [i for i in ids if i != "pad"]
        self.assertEqual(len(starts), len(set(starts)))
        self.assertEqual(self.r.dropped, 0)

    def test_full_ring_drops_and_counts(self):
        n = 0
        while self.r.dropped == 0:
            with faultline.span("forward"):
                pass
            n += 1
            self.assertLess(n, self.capacity)
        for _ in range(10):
            with faultline.span("forward"):
                pass
            faultline.mark("forward")
        self.assertEqual(self.r.dropped, 21)
        self.assertEqual(faultline.dropped(), 21)
        recs = self.r.read()
        self.assertEqual(len(recs), 2 * (n - 1))
        # Room again: records flow.
        with faultline.span("forward"):
            pass
        self.assertEqual(len(self.r.read()), 2)

    def test_too_many_open_ranges_drop_and_count(self):
        from contextlib import ExitStack
        with ExitStack() as stack:
            for _ in range(_ring.MAX_OPEN + 5):
                stack.enter_context(faultline.span("forward"))
        self.assertEqual(self.r.dropped, 5)
        recs = self.r.read()
        self.assertEqual(len(recs), 2 * _ring.MAX_OPEN)
        # Depth is back to zero: a new range is written.
        with faultline.span("forward"):
            pass
        self.assertEqual(len(self.r.read()), 2)
        # An exit without an enter does nothing.
        faultline.span("forward").__exit__(None, None, None)
        self.assertEqual(self.r.read(), [])

    def test_threads(self):
        def work():
            for i in range(300):
                with faultline.span("forward"):
                    faultline.mark("dataloader")

        for locked in (False, True):
            _ring.detach()
            _ring._use_lock(locked)
            try:
                _ring.attach(self.path)
                dropped0 = self.r.dropped
                got = []
                stop = threading.Event()

                def drain():
                    while not stop.is_set():
                        got.extend(self.r.read())
                        time.sleep(0.001)

                d = threading.Thread(target=drain)
                d.start()
                ts = [threading.Thread(target=work) for _ in range(4)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                stop.set()
                d.join()
                got.extend(self.r.read())
                dropped = self.r.dropped - dropped0
                starts = [x for x in got if x["type"] == START]
                ends = [x for x in got if x["type"] == END]
                marks = [x for x in got if x["type"] == MARK]
                # A range is written or dropped whole, a mark alike.
                self.assertEqual(len(starts) + len(marks) + dropped,
                                 2 * 4 * 300, locked)
                self.assertEqual([x["id"] for x in starts],
                                 [x["id"] for x in ends])
                self.assertEqual(len({x["tid"] for x in marks}), 4)
            finally:
                _ring.detach()
                _ring._use_lock(False)

    def test_collectives(self):
        rec = _ring.collective("allreduce", "default_pg", 1024, "float32")
        rid = _ring.collective_start(rec, 1024)
        _ring.collective_end(rid)
        rid2 = _ring.collective_start(rec, 1 << 40)
        _ring.collective_error(rid2, "Connection closed by peer " + "é" * 600)
        recs = self.r.read()
        self.assertEqual([x["type"] for x in recs], [4, 5, 4, 6])
        self.assertEqual(json.loads(recs[0]["name"]),
                         {"opName": "allreduce", "groupName": "default_pg",
                          "count": "1024", "dataType": "float32"})
        self.assertEqual(recs[0]["aux"], 1024)
        self.assertEqual(recs[2]["aux"], 0)  # too large for aux
        self.assertEqual(recs[0]["id"], recs[1]["id"])
        self.assertEqual(recs[2]["id"], recs[3]["id"])
        self.assertTrue(recs[3]["name"].startswith("Connection closed"))
        self.assertLessEqual(len(recs[3]["name"].encode()), 1024)
        # Not timed when the agent's flag is off, whatever the switch.
        self.r.set_word(28, 0)
        self.assertEqual(_ring.collective_start(rec), 0)
        self.assertFalse(_ring.timing_collectives())
        self.assertEqual(self.r.read(), [])

    def test_fork_child_does_not_write(self):
        pid = os.fork()
        if pid == 0:
            try:
                with faultline.span("forward"):
                    pass
                os._exit(0 if _ring._producer is None else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(os.waitstatus_to_exitcode(status), 0)
        self.assertEqual(self.r.read(), [])


class AttachTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="faultline-ring-")

    def tearDown(self):
        _ring.detach()
        shutil.rmtree(self.dir)

    def test_bad_rings_are_refused_naming_the_file(self):
        p = os.path.join(self.dir, "r")
        cases = {
            "short": lambda: make_ring(p) and os.truncate(p, 100),
            "magic": lambda: make_ring(p) and self._poke(p, 0, b"NOTARING"),
            "capacity": lambda: make_ring(p, capacity=3 << 16),
            "small": lambda: make_ring(p, capacity=1 << 12),
            "size": lambda: make_ring(p) and os.truncate(p, 8192),
            "index": lambda: make_ring(p) and self._poke(p, 64, b"\x03"),
        }
        for what, make in cases.items():
            make()
            with self.assertRaises(_ring.RingError, msg=what) as cm:
                _ring.attach(p)
            self.assertIn(p, str(cm.exception))
        with self.assertRaises(OSError):
            _ring.attach(os.path.join(self.dir, "missing"))

    def _poke(self, p, off, b):
        with open(p, "r+b") as f:
            f.seek(off)
            f.write(b)
        return True

    def test_without_a_ring_span_is_off(self):
        _ring.detach()
        self.assertIs(faultline.span("forward"), _ring._OFF)
        with faultline.span("forward"):
            faultline.mark("forward")
        self.assertEqual(faultline.dropped(), 0)

    def test_environment_names_the_ring(self):
        p = make_ring(os.path.join(self.dir, "r"))
        os.environ["FAULTLINE_RING"] = p
        try:
            faultline._reset()
            self.assertIsNotNone(_ring._producer)
            os.environ["FAULTLINE_RING"] = os.path.join(self.dir, "missing")
            with self.assertWarns(RuntimeWarning):
                faultline._reset()
            self.assertIsNone(_ring._producer)
        finally:
            del os.environ["FAULTLINE_RING"]
            faultline._reset()


if __name__ == "__main__":
    unittest.main()
