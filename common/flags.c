#include "pd_flags.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f, const char *cmd, const pd_flag *flags, int n) {
    fprintf(f, "usage: pdserve %s [flags]\n", cmd);
    for (int i = 0; i < n; i++)
        fprintf(f, "  --%-28s %s\n", flags[i].name, flags[i].help);
}

int pd_flags_parse(const char *cmd, const pd_flag *flags, int n, int argc, char **argv) {
    struct option *opts = calloc((size_t)n + 2, sizeof *opts);
    for (int i = 0; i < n; i++) {
        opts[i].name = flags[i].name;
        opts[i].has_arg = flags[i].kind == PD_FLAG_BOOL ? no_argument : required_argument;
        opts[i].val = 1000 + i;
    }
    opts[n].name = "help";
    opts[n].val = 'h';
    optind = 1;
    opterr = 0;
    int ch, rc = 0;
    while (rc == 0 && (ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (ch == 'h') {
            usage(stdout, cmd, flags, n);
            rc = 1;
            break;
        }
        if (ch < 1000 || ch >= 1000 + n) {
            fprintf(stderr, "pdserve %s: unknown or incomplete flag '%s'\n", cmd, argv[optind - 1]);
            rc = 2;
            break;
        }
        const pd_flag *f = &flags[ch - 1000];
        char *end = NULL;
        errno = 0;
        switch (f->kind) {
        case PD_FLAG_STR: *(const char **)f->dst = optarg; break;
        case PD_FLAG_BOOL: *(bool *)f->dst = true; break;
        case PD_FLAG_INT: {
            long v = strtol(optarg, &end, 10);
            if (errno || *end || end == optarg || v < -2147483647L || v > 2147483647L) {
                fprintf(stderr, "pdserve %s: --%s needs an integer, got '%s'\n", cmd, f->name, optarg);
                rc = 2;
            } else
                *(int *)f->dst = (int)v;
            break;
        }
        case PD_FLAG_FLOAT: {
            double v = strtod(optarg, &end);
            if (errno || *end || end == optarg) {
                fprintf(stderr, "pdserve %s: --%s needs a number, got '%s'\n", cmd, f->name, optarg);
                rc = 2;
            } else
                *(double *)f->dst = v;
            break;
        }
        }
    }
    if (rc == 0 && optind < argc) {
        fprintf(stderr, "pdserve %s: unexpected argument '%s'\n", cmd, argv[optind]);
        rc = 2;
    }
    free(opts);
    return rc;
}
