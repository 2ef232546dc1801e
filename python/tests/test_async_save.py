"""Checkpointer.save_checkpoint(..., blocking=False) in a training loop:
kept as soon as its copy is done, abandoned (and said) when a tensor
changed before that, and load_checkpoint called again in a process."""

import os
import threading
import time
import unittest
import warnings

import torch

import faultline
import faultline.torch as ft

from helpers import FakeAgent
from test_checkpoint import bits, model_and_optimizer


def train_step(model, opt):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()


class AsyncSaveTest(unittest.TestCase):
    def setUp(self):
        self.agent = FakeAgent()
        os.environ["FAULTLINE_AGENT"] = self.agent.sock
        faultline._reset()
        self.ckpt = ft.Checkpointer(os.path.join(self.agent.dir, "ckpt"))

    def tearDown(self):
        self.ckpt.wait()
        del os.environ["FAULTLINE_AGENT"]
        faultline._reset()
        self.agent.close()

    def settled(self):
        """Runs Python code (no tensor operation) until the save in flight
        is kept or abandoned."""
        a = self.ckpt._pending
        deadline = time.monotonic() + 30
        while a.kept is None and time.monotonic() < deadline:
            sum(range(100))
        return a.kept

    def test_kept_as_soon_as_its_copy_is_done(self):
        # The training loop of the bug report: every save is followed by
        # the next step's optimizer.step(), which moves every version
        # counter; the save was kept before that.
        model, opt = model_and_optimizer()
        for step in range(1, 6):
            train_step(model, opt)
            state = {"model": model.state_dict(),
                     "optimizer": opt.state_dict(), "step": step}
            want = bits(state)
            self.assertTrue(self.ckpt.save_checkpoint(step, state,
                                                      blocking=False))
            self.assertTrue(self.settled(), f"step {step}")
        train_step(model, opt)
        self.assertTrue(self.ckpt.wait())
        self.assertEqual(bits(self.ckpt.load_checkpoint()), want)
        self.assertEqual(self.agent.ops().count("saved"), 5)
        self.assertNotIn("abandoned", self.agent.ops())

    def test_a_save_torn_by_an_update_is_abandoned_and_said(self):
        # A layer over 64 KiB, which the save copies in the background.
        torch.manual_seed(3)
        model = torch.nn.Linear(8, 4096)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        self.assertTrue(self.ckpt.save_checkpoint(
            1, {"model": model.state_dict(), "step": 1}))
        gate = threading.Event()
        copy = ft._AsyncSave._copy

        def held_copy(self_, write):
            gate.wait()
            copy(self_, write)

        ft._AsyncSave._copy = held_copy
        try:
            self.assertTrue(self.ckpt.save_checkpoint(
                2, {"model": model.state_dict(), "step": 2}, blocking=False))
            train_step(model, opt)  # while the copy has not begun
            gate.set()
            self.assertFalse(self.settled())
        finally:
            ft._AsyncSave._copy = copy
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            self.assertFalse(self.ckpt.wait())
        self.assertTrue(any("step 2" in str(x.message)
                            and "abandoned" in str(x.message) for x in w),
                        [str(x.message) for x in w])
        said = [r for r in self.agent.requests if r["op"] == "abandoned"]
        self.assertEqual([r["step"] for r in said], [2])
        self.assertIn("changed", said[0]["what"])
        self.assertEqual(self.ckpt.load_checkpoint()["step"], 1)
        # The next save goes on as usual.
        self.assertTrue(self.ckpt.save_checkpoint(
            3, {"model": model.state_dict(), "step": 3}, blocking=False))
        self.assertTrue(self.ckpt.wait())
        self.assertEqual(self.ckpt.load_checkpoint()["step"], 3)

    def test_small_tensors_are_copied_before_the_save_returns(self):
        # BatchNorm's running statistics change in the next forward, as
        # soon as the save returns: copied before, no save is torn.
        model, opt = model_and_optimizer()
        for step in range(1, 4):
            train_step(model, opt)
            state = {"model": model.state_dict(), "step": step}
            want = bits(state)
            self.assertTrue(self.ckpt.save_checkpoint(step, state,
                                                      blocking=False))
            model.train()(torch.randn(4, 8))  # moves the statistics
            self.assertTrue(self.ckpt.wait(), f"step {step}")
            self.assertEqual(bits(self.ckpt.load_checkpoint()), want)

    def test_skipped_saves_are_said(self):
        model, _ = model_and_optimizer()
        state = lambda step: {"model": model.state_dict(), "step": step}
        self.assertTrue(self.ckpt.save_checkpoint(1, state(1)))
        self.assertTrue(self.ckpt.save_checkpoint(2, state(2)))
        seg = self.ckpt._seg
        # The owner reads both halves (a persist of one, a replica of the
        # other): no save can go.
        for i in (0, 1):
            seg.u32[seg.base(i) // 4 + 1] = 1
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            self.assertFalse(self.ckpt.save_checkpoint(3, state(3)))
            self.assertFalse(self.ckpt.save_checkpoint(4, state(4)))
            for i in (0, 1):
                seg.u32[seg.base(i) // 4 + 1] = 0
            self.assertTrue(self.ckpt.save_checkpoint(5, state(5)))
        said = [str(x.message) for x in w]
        self.assertEqual(len(said), 2, said)
        self.assertIn("the save of step 3 was skipped", said[0])
        self.assertIn("2 saves were skipped, steps 3 to 4", said[1])

    def test_a_save_from_another_thread_is_settled_at_the_next_call(self):
        model, opt = model_and_optimizer()
        out = {}

        def loop():
            self.ckpt.save_checkpoint(4, {"model": model.state_dict(),
                                          "step": 4}, blocking=False)
            time.sleep(0.2)
            out["kept"] = self.ckpt.wait()

        t = threading.Thread(target=loop)
        t.start()
        t.join()
        self.assertTrue(out["kept"])
        self.assertEqual(self.ckpt.load_checkpoint()["step"], 4)


class LoadAgainTest(unittest.TestCase):
    """load_checkpoint called again in a process: the newest step held,
    never a stale one and never {} while a step is held."""

    def setUp(self):
        self.agent = FakeAgent()
        os.environ["FAULTLINE_AGENT"] = self.agent.sock
        faultline._reset()
        self.ckpt = ft.Checkpointer(os.path.join(self.agent.dir, "ckpt"))

    def tearDown(self):
        del os.environ["FAULTLINE_AGENT"]
        faultline._reset()
        self.agent.close()

    def test_every_call_loads_the_newest(self):
        for step in range(6):
            self.assertTrue(self.ckpt.save_checkpoint(
                step, {"w": torch.full((1000,), float(step)), "step": step}))
            got = self.ckpt.load_checkpoint()
            self.assertEqual(got["step"], step)
            self.assertTrue(torch.equal(got["w"], torch.full((1000,),
                                                             float(step))))
        loads = [r for r in self.agent.requests if r["op"] == "load"]
        self.assertNotIn("step", loads[0])  # the first: the job's choice
        self.assertEqual([r["step"] for r in loads[1:]], list(range(1, 6)))

    def test_a_job_of_several_ranks_without_torch_distributed(self):
        self.ckpt.save_checkpoint(0, {"step": 0})
        self.ckpt.load_checkpoint()
        os.environ["WORLD_SIZE"] = "2"
        try:
            with self.assertRaisesRegex(RuntimeError, "collective"):
                self.ckpt.load_checkpoint()
        finally:
            del os.environ["WORLD_SIZE"]


if __name__ == "__main__":
    unittest.main()
