package trace

// Flags returns the flags of kind k's start, end and instant records, as
// the Recorder writes them (MindCluster's: device flags for steps, forward
// and communication, host flags for data loading and checkpoints), for a
// writer of records other than the Recorder.
func (k Kind) Flags() (start, end, instant Flag) {
	if k >= numKinds {
		return FlagHostStart, FlagHostEnd, FlagInstant
	}
	return startFlags[k], endFlags[k], instantFlags[k]
}
