/* Raw bytes after the HTTP/2 client preface → the gateway's h2 connection
 * layer (frames through nghttp2 into gateway/gw_http2.c's callbacks, then
 * the same streams, OpenAI endpoints and scripted engine as fuzz_http1):
 * the harness is fuzz_http1.c with the 24-octet preface sent first, so
 * every input is a sequence of frames on a prior-knowledge h2c connection.
 * Seeds were made with python3-h2 (a client connection's frames, preface
 * cut): SETTINGS, HEADERS + DATA for GET and POST, two concurrent streams,
 * RST_STREAM, PING, WINDOW_UPDATE, GOAWAY, a 1-byte initial window. */
#define FZ_PREFIX "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#include "fuzz_http1.c"
