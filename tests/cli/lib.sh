# Shared by the tests/cli scripts ('. "$(dirname "$0")/lib.sh"').

# free_port_pair: prints a free TCP port P on 127.0.0.1 with P + 1 free too
# (pdserve up takes PORT for HTTP and PORT + 1 for its control socket and
# refuses a busy one). Free when asked: another process may take it after.
free_port_pair() {
    python3 -c 'import socket
while True:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
    t = socket.socket()
    try:
        t.bind(("127.0.0.1", p + 1)); t.close(); print(p); break
    except OSError:
        t.close()'
}
