/* pdserve version [--deps]: the version and build options; with --deps the
 * libraries loaded at run time next to the headers the build used. */
#include <stdbool.h>
#include <stdio.h>

#include "pd_cli.h"
#include "pd_flags.h"
#include "pd_version.h"

int pd_cmd_version(int argc, char **argv) {
    bool deps = false;
    pd_flag flags[] = {
        {"deps", PD_FLAG_BOOL, &deps,
         "also the libraries loaded at run time against the build's headers"},
    };
    int rc = pd_flags_parse("version", flags, (int)(sizeof flags / sizeof flags[0]), argc, argv);
    if (rc)
        return rc == 1 ? 0 : 2;
    printf("%s\n", pd_version_line());
    if (!deps)
        return 0;
    pd_dep_version d[PD_DEPS_MAX];
    int n = pd_version_deps(d, PD_DEPS_MAX);
    printf("\n%-14s %-16s %s\n", "library", "built against", "loaded at run time");
    for (int i = 0; i < n; i++) {
        printf("%-14s %-16s %s\n", d[i].name, d[i].compiled, d[i].loaded);
        if (d[i].mismatch)
            printf("%-14s ^ MISMATCH: %s\n", "", d[i].note);
    }
    int bad = pd_version_deps_mismatches(d, n);
    printf("\n%d libraries, %d mismatch%s\n", n, bad, bad == 1 ? "" : "es");
    return 0;
}
