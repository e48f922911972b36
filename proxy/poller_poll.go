package proxy

import (
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// The poll(2) poller (poller.go): every Unix has it, so the loop runs on
// every Unix; it is the default outside Linux. poll(2) is level-triggered,
// as the loop's interest is; the rest is emulated:
//
//   - one-shot: once a one-shot descriptor has reported, it is left out of
//     the set polled until it is modified (poll(2) reports a hang-up
//     whatever is asked, so asking for nothing is not enough);
//   - a change while the loop waits: the set polled is the loop thread's
//     copy, built before the wait from the registrations; a change made
//     meanwhile (by another goroutine) marks it stale and writes to a
//     wake-up descriptor that is always in the set, so the wait ends
//     (EINTR) and the next one polls the new set. An event of a
//     descriptor changed or removed meanwhile is dropped: the new
//     registration is polled at once, and level-triggered readiness is
//     reported again;
//   - evRDHup is never asked for nor reported (POLLRDHUP is Linux's
//     only): a half-close is readable, and a read returns 0.
//
// Each wait costs the length of the set (poll(2) does), which epoll does
// not; that is why epoll is the default on Linux.
type pollPoller struct {
	wakeR, wakeW int // the wake-up: readable once written (wakeFD)

	mu      sync.Mutex
	slots   []pollSlot    // the registrations
	at      map[int32]int // a registered descriptor's index in slots
	gen     uint32        // counts registrations (pollSlot.gen)
	stale   bool          // slots changed since the set polled was built
	waiting bool          // the loop thread polls the set built before
	woken   bool          // the wake-up was written during this wait

	// The set polled, the loop thread's: fds[0] is the wake-up, gens[i]
	// the gen of the registration fds[i] was built from.
	fds  []unix.PollFd
	gens []uint32
}

// pollSlot is one registration.
type pollSlot struct {
	fd     int32
	events uint32 // the loop's interest (evIn...)
	gen    uint32 // tells this registration from an earlier one of fd
	off    bool   // one-shot and reported: not polled until modified
}

func newPollPoller() (poller, error) {
	r, w, err := newWakeFD()
	if err != nil {
		return nil, err
	}
	return &pollPoller{
		wakeR: r, wakeW: w,
		at:   map[int32]int{},
		fds:  []unix.PollFd{{Fd: int32(r), Events: unix.POLLIN}},
		gens: []uint32{0},
	}, nil
}

func (p *pollPoller) add(fd int, events uint32) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.at[int32(fd)]; ok {
		return syscall.EEXIST
	}
	p.gen++
	p.at[int32(fd)] = len(p.slots)
	p.slots = append(p.slots, pollSlot{fd: int32(fd), events: events, gen: p.gen})
	p.changed()
	return nil
}

func (p *pollPoller) modify(fd int, events uint32) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.at[int32(fd)]
	if !ok {
		return syscall.ENOENT
	}
	p.gen++
	p.slots[i] = pollSlot{fd: int32(fd), events: events, gen: p.gen}
	p.changed()
	return nil
}

func (p *pollPoller) remove(fd int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, ok := p.at[int32(fd)]
	if !ok {
		return syscall.ENOENT
	}
	last := len(p.slots) - 1
	if i != last {
		p.slots[i] = p.slots[last]
		p.at[p.slots[i].fd] = i
	}
	p.slots = p.slots[:last]
	delete(p.at, int32(fd))
	p.changed()
	return nil
}

// changed marks the set polled stale and wakes a wait in progress (once).
// p.mu is held.
func (p *pollPoller) changed() {
	p.stale = true
	if p.waiting && !p.woken {
		p.woken = true
		wake(p.wakeW)
	}
}

func (p *pollPoller) wait(events []pollEvent, msec int) (int, syscall.Errno) {
	p.prepare()
	n, errno := pollRaw(p.fds, msec)
	return p.harvest(events, n, errno)
}

func (p *pollPoller) waitIdle(events []pollEvent) (int, syscall.Errno) {
	p.prepare()
	n, errno := pollBlock(p.fds)
	return p.harvest(events, n, errno)
}

// prepare builds the set to poll if the registrations changed, and marks
// the wait begun. Loop thread.
func (p *pollPoller) prepare() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stale {
		p.fds, p.gens = p.fds[:1], p.gens[:1] // the wake-up stays
		for _, s := range p.slots {
			if s.off {
				continue
			}
			var e int16
			if s.events&evIn != 0 {
				e |= unix.POLLIN
			}
			if s.events&evOut != 0 {
				e |= unix.POLLOUT
			}
			p.fds = append(p.fds, unix.PollFd{Fd: s.fd, Events: e})
			p.gens = append(p.gens, s.gen)
		}
		p.stale = false
	}
	p.waiting = true
}

// harvest puts the events of the n descriptors poll(2) reported ready
// into events, as far as they are still registered as they were polled,
// and disarms the one-shot ones reported. Loop thread.
func (p *pollPoller) harvest(events []pollEvent, n int, errno syscall.Errno) (int, syscall.Errno) {
	p.mu.Lock()
	defer p.mu.Unlock()
	woken := p.woken
	p.waiting, p.woken = false, false
	if errno != 0 || n <= 0 {
		return 0, errno
	}
	if p.fds[0].Revents != 0 {
		drainWake(p.wakeR)
		woken = true
		n--
	}
	k := 0
	for i := 1; i < len(p.fds) && n > 0 && k < len(events); i++ {
		re := p.fds[i].Revents
		if re == 0 {
			continue
		}
		n--
		j, ok := p.at[p.fds[i].Fd]
		if !ok || p.slots[j].gen != p.gens[i] || p.slots[j].off {
			continue // changed meanwhile: polled again as it is now
		}
		s := &p.slots[j]
		var ev uint32
		if re&unix.POLLIN != 0 {
			ev |= evIn
		}
		if re&unix.POLLOUT != 0 {
			ev |= evOut
		}
		if re&unix.POLLHUP != 0 {
			ev |= evHup
		}
		if re&(unix.POLLERR|unix.POLLNVAL) != 0 {
			ev |= evErr
		}
		if ev &= s.events | evHup | evErr; ev == 0 {
			continue
		}
		events[k] = pollEvent{Fd: s.fd, Events: ev}
		k++
		if s.events&evOneShot != 0 {
			s.off, p.stale = true, true
		}
	}
	if k == 0 && woken {
		return 0, syscall.EINTR // a change, not a timeout: wait again
	}
	return k, 0
}

func (p *pollPoller) close() error {
	closeWakeFD(p.wakeR, p.wakeW)
	return nil
}

func (*pollPoller) name() string { return "poll" }
