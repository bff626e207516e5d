# Shared by the tests/cli scripts ('. "$(dirname "$0")/lib.sh"').

# free_port_pair: prints a free TCP port P on 127.0.0.1 with P + 1 free too
# (pdserve up takes PORT for HTTP and PORT + 1 for its control socket and
# refuses a busy one), drawn at random below the kernel's ephemeral range,
# where ports bound to 0 by other processes come from (the rule of
# tests/integration/pdtest.py's free_port_pair). Free when asked: another
# process may take it after.
free_port_pair() {
    python3 -c 'import random, socket
try:
    lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
except Exception:
    lo = 32768
rng = random.SystemRandom()
while True:
    p = rng.randrange(10000, max(lo - 2, 10002))
    try:
        for q in (p, p + 1):
            t = socket.socket()
            try:
                t.bind(("127.0.0.1", q))
            finally:
                t.close()
        print(p); break
    except OSError:
        pass'
}
