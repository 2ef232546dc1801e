"""The segment's save protocol as a writer follows it: which half a save
takes, and which it must leave alone."""

import os
import struct
import tempfile
import unittest

from faultline import _segment

from helpers import make_segment, newest_half


def save(seg, step, persist=False):
    """Saves a one-blob step; returns (seq, half), or None when skipped."""
    data = struct.pack("<q", step) * 8

    def write(i, off):
        seg.mv[off:off + len(data)] = data

    return seg.save(step, ["b"], [len(data)], write, persist)


class HeldHalves(unittest.TestCase):
    def setUp(self):
        d = tempfile.mkdtemp(prefix="faultline-seg-")
        self.path = make_segment(os.path.join(d, "seg"), 4096)
        self.addCleanup(os.rmdir, d)
        self.addCleanup(os.unlink, self.path)
        self.seg = _segment.Segment(self.path)
        self.addCleanup(self.seg.close)

    def steps(self):
        return sorted(self.seg.read(i).step for i in (0, 1)
                      if self.seg._meta_ok(i)[0])

    def test_a_step_asked_to_persist_is_kept_until_the_owner_is_done(self):
        save(self.seg, 4, persist=True)
        for step in (5, 6, 7):
            self.assertIsNotNone(save(self.seg, step))
        # The saves after the request went over the newest step, never over
        # the one the owner has yet to persist.
        self.assertEqual(self.steps(), [4, 7])
        self.assertEqual(newest_half(self.path)[2], 7)
        # The owner clears the request once done: the half is free again.
        self.seg.u64[40 // 8] = 0
        save(self.seg, 8)
        self.assertEqual(self.steps(), [7, 8])

    def test_a_request_waits_for_the_one_before(self):
        save(self.seg, 4, persist=True)
        self.seg.persist_wait = 0.05
        # The owner has not persisted 4: 5 is not saved over it, nor asked.
        with self.assertRaises(_segment.PersistTimeout):
            save(self.seg, 5, persist=True)
        self.assertEqual(self.steps(), [4])
        self.seg.u64[40 // 8] = 0  # the owner is done with 4
        save(self.seg, 5, persist=True)
        self.assertEqual(self.steps(), [4, 5])
        self.assertEqual(self.seg.u64[40 // 8], self.seg._seq(
            newest_half(self.path)[0]))

    def test_a_save_is_skipped_when_both_halves_are_held(self):
        save(self.seg, 4, persist=True)
        save(self.seg, 5)
        held = self.seg.read(1 - newest_half(self.path)[0])
        newest = 1 - held.index
        self.seg.u32[self.seg.base(newest) // 4 + 1] = 1  # the owner reads it
        self.assertIsNone(save(self.seg, 6))
        self.assertEqual(self.steps(), [4, 5])


if __name__ == "__main__":
    unittest.main()
