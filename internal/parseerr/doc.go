// Package parseerr renders the messages of the ParseError types of the
// leaf packages (trace, hang, topology, ckpt/layout), which share one
// shape, so that a rejected input reads alike whichever package refused
// it:
//
//	trace: profiling switch: field Step: value "maybe": want "on" or "off"
//	hang: stack file: /stacks/00003-00008.stacktrace:4: last line cut short
//	layout: /dev/shm/x: offset 60: field meta_crc32c: value 0x1, computed 0x2
package parseerr
