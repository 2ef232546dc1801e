package trace

import (
	"fmt"
	"iter"
)

// Kind is a training phase that dotting can record. Its String form is the
// field name used in the profiling switch document.
type Kind uint8

// The kinds, in the order of the switch document's fields as MindCluster
// names them.
const (
	Step Kind = iota
	FP
	DataLoader
	SaveCheckpoint
	CommunicationOperator
	numKinds
)

var kinds = [numKinds]Kind{Step, FP, DataLoader, SaveCheckpoint, CommunicationOperator}

// Kinds yields every kind, in order.
func Kinds() iter.Seq[Kind] {
	return func(yield func(Kind) bool) {
		for _, k := range kinds {
			if !yield(k) {
				return
			}
		}
	}
}

var kindNames = [numKinds]string{"Step", "FP", "DataLoader", "SaveCheckpoint", "CommunicationOperator"}

// Marker names that analysis tools key on (domain default). A step marker is
// "step <n>"; communication markers carry a CommOp as JSON in their name.
const (
	MarkerForward        = "forward"
	MarkerDataLoader     = "dataloader"
	MarkerSaveCheckpoint = "save_checkpoint"
	StepMarkerPrefix     = "step "
)

// Marker domains.
const (
	DomainDefault       = "default"
	DomainCommunication = "communication"
)

// String returns the switch field name of k, or "Kind(n)" for an unknown k.
func (k Kind) String() string {
	if k < numKinds {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// Domain returns the marker domain records of kind k belong to.
func (k Kind) Domain() string {
	if k == CommunicationOperator {
		return DomainCommunication
	}
	return DomainDefault
}

// ParseKind returns the kind whose switch field name is s.
func ParseKind(s string) (Kind, bool) {
	for i, n := range kindNames {
		if n == s {
			return Kind(i), true
		}
	}
	return 0, false
}
