// Package trainertest is a fake training loop for tests and demos of
// taskd's orchestration: a Trainer that implements taskd.Trainer over a
// real step loop, so that a pause really stops the steps, a hang really
// stops them forever, and a resume from a checkpoint really moves the step
// counter back.
//
// The loop runs numbered steps (0, 1, ...) at StepTime each, saves a
// checkpoint every SaveEvery steps through Config.Save, and reports what
// happens through Config.OnEvent. It begins paused, as taskd.Trainer asks;
// Hang and FailNext inject faults. CkptState saves the step counter into a
// ckpt segment (persisting every so many saves) and loads it back, for
// tests that check that a recovery loses no step beyond the newest intact
// checkpoint.
//
// A worker process with a fake trainer:
//
//	tr := trainertest.New(trainertest.Config{StepTime: 10 * time.Millisecond})
//	w, err := taskd.NewWorker(taskd.WorkerConfig{Job: "job-1", Node: 0, Rank: 3, Security: sec, Trainer: tr})
//	...
//	go w.Run(ctx)
//	err = tr.Run(ctx) // until ctx ends or the manager stops the job
package trainertest
