# Shared by the tests/cli scripts ('. "$(dirname "$0")/lib.sh"').

# free_port_pair: prints a free TCP port P on 127.0.0.1 with P + 1 free too
# (pdserve up takes PORT for HTTP and PORT + 1 for its control socket and
# refuses a busy one): tests/integration/pdtest.py's free_port_pair, which
# draws it below the kernel's ephemeral range. Free when asked: another
# process may take it after.
free_port_pair() {
    PYTHONPATH="$(dirname "$0")/../integration${PYTHONPATH:+:$PYTHONPATH}" \
        python3 -c 'import pdtest; print(pdtest.free_port_pair())'
}
