/* pdserve verify --model DIR [--manifest FILE] [--write-manifest FILE] [--jobs N] [--no-hash]
 *
 * Exit status: 0 when every check holds, 1 when any fails (each problem on
 * stderr, naming the file and the tensor), 2 on a usage error. */
#include <stdbool.h>
#include <stdio.h>

#include "pd_cli.h"
#include "pd_flags.h"
#include "pd_model.h"

int pd_cmd_verify(int argc, char **argv) {
    const char *model = NULL, *manifest = NULL, *write_manifest = NULL;
    int jobs = 4;
    bool no_hash = false, quiet = false;
    pd_flag flags[] = {
        {"model", PD_FLAG_STR, &model, "checkpoint directory (config.json, safetensors, index)"},
        {"manifest", PD_FLAG_STR, &manifest, "JSON {file: {size, sha256}} every file must match"},
        {"write-manifest", PD_FLAG_STR, &write_manifest,
         "write that JSON for this directory (when all holds)"},
        {"jobs", PD_FLAG_INT, &jobs, "files hashed at once (default 4)"},
        {"no-hash", PD_FLAG_BOOL, &no_hash, "sizes, headers and config only (no SHA-256)"},
        {"quiet", PD_FLAG_BOOL, &quiet, "no progress line"},
    };
    int rc = pd_flags_parse("verify", flags, (int)(sizeof flags / sizeof flags[0]), argc, argv);
    if (rc)
        return rc == 1 ? 0 : 2;
    if (!model || jobs < 1 || (no_hash && (manifest || write_manifest))) {
        fprintf(
            stderr,
            "pdserve verify: --model DIR is required, --jobs must be >= 1, and --no-hash excludes "
            "the manifest flags\n");
        return 2;
    }
    pd_verify_options o = {.manifest = manifest,
                           .write_manifest = write_manifest,
                           .hash = !no_hash,
                           .jobs = jobs,
                           .progress = !quiet};
    pd_verify_report r;
    pd_err err = {{0}};
    pd_status st = pd_verify_checkpoint(model, &o, &r, &err);
    if (!no_hash)
        fprintf(stderr, "verify: read %.1f MB in %.2f s: %.0f MB/s (%d jobs)\n",
                r.bytes_hashed / 1e6, r.hash_seconds, r.mb_per_s, jobs);
    if (st != PD_OK) {
        fprintf(stderr, "verify: FAILED: %s: %d problem%s (first: %s)\n", model, r.n_problems,
                r.n_problems == 1 ? "" : "s", err.msg);
        return 1;
    }
    printf("verify: OK: %s: %d files, %d shard%s, %zu tensors (%zu implied by config.json)%s%s%s\n",
           model, r.n_files, r.n_shards, r.n_shards == 1 ? "" : "s", r.n_tensors,
           r.n_config_tensors, manifest ? ", all match " : "", manifest ? manifest : "",
           no_hash ? ", not hashed" : "");
    if (r.manifest_written)
        printf("verify: wrote %s\n", write_manifest);
    return 0;
}
