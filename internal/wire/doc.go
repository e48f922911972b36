// Package wire holds the PostgreSQL protocol rules (protocol 3.0, after
// startup) that every relay path of the proxy applies, written once:
//
//   - the message-type tables: what a client may send (the framers check it), which
//     client messages over the size limit PostgreSQL answers with an error
//     (Answerable), which get a response of their own (ProducesResponse),
//     which server messages answer which request and what ends one
//     (ReadyForQuery for a Query, Sync or FunctionCall, an ErrorResponse
//     skipping an extended batch to its Sync: Queue);
//   - header parsing (ParseHeader) and the errors a bad header is
//     (ProtocolError with SQLSTATE 08P01);
//   - two framers of one stream of messages with the same checks: Framer,
//     which reads a bufio.Reader and may block, and Scanner, which is fed
//     the bytes of a non-blocking socket as they arrive and reports
//     message boundaries and ReadyForQuery status bytes;
//   - the outstanding-request queue (Queue, Request), which matches the
//     server's messages to the requests sent, pipelined;
//   - the transaction status and the count of requests whose
//     ReadyForQuery is due (Status).
//
// Neither framer allocates or copies per message: a message is a slice
// of the reader's (or the caller's) buffer.
//
// It is not a message decoder (pgproto3 decodes the few messages the
// proxy reads), it does no I/O of its own (the framer reads what its
// reader gives it; sockets, the event loop and teardown are the proxy's),
// and it knows nothing of the write gate, PAUSE or shutdown: the proxy acts
// on what these types report.
package wire
