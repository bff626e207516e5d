/* Command-line flags shared by the services: a tiny table-driven parser
 * over getopt_long, so every service spells its flags the vLLM way
 * (--max-num-seqs 256 or --max-num-seqs=256). */
#ifndef PD_FLAGS_H
#define PD_FLAGS_H

#include <stdbool.h>

typedef enum { PD_FLAG_STR, PD_FLAG_INT, PD_FLAG_FLOAT, PD_FLAG_BOOL } pd_flag_kind;

typedef struct {
    const char *name; /* without the leading "--" */
    pd_flag_kind kind;
    void *dst;        /* const char **, int *, double *, bool * */
    const char *help;
} pd_flag;

/** Parses argv (argv[0] is the command name) into the flags' destinations.
 * Returns 0 on success, 1 when --help was printed, 2 on a bad flag or value
 * (a message naming the flag is printed to stderr). */
int pd_flags_parse(const char *cmd, const pd_flag *flags, int n, int argc, char **argv);

#endif
