/* Safetensors file bytes → pd_st_open_file (through a memfd, so the real
 * open/fstat/mmap path runs), then every accepted tensor is looked up by
 * name and read in full. Properties: an accepted header describes tensors
 * whose bytes lie inside the file, whose size is numel x dtype size, and
 * whose names find them. */
#define _GNU_SOURCE /* memfd_create */
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzz_util.h"
#include "pd_model.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fz_quiet_logs();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int fd = memfd_create("fuzz.safetensors", MFD_CLOEXEC);
    if (fd < 0)
        return 0;
    size_t off = 0;
    while (off < size) {
        ssize_t w = write(fd, data + off, size - off);
        if (w <= 0) {
            close(fd);
            return 0;
        }
        off += (size_t)w;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    pd_safetensors *st = NULL;
    pd_err err = {{0}};
    pd_status rc = pd_st_open_file(path, &st, &err);
    if (rc != PD_OK) {
        FZ_CHECK(err.msg[0] != 0 && st == NULL, "status %s", pd_status_str(rc));
        close(fd);
        return 0;
    }
    uint64_t header = 0;
    FZ_CHECK(size >= 8, "accepted a file of %zu bytes", size);
    memcpy(&header, data, 8);
    FZ_CHECK(header <= size - 8, "accepted a header past the end");
    size_t data_section = size - 8 - (size_t)header;
    size_t total = 0;
    for (size_t i = 0; i < pd_st_count(st); i++) {
        const pd_st_tensor *t = pd_st_at(st, i);
        FZ_CHECK(t && t->name && t->ndim >= 0 && t->ndim <= PD_ST_MAX_DIMS, "tensor %zu", i);
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++)
            numel *= (uint64_t)t->shape[d];
        FZ_CHECK(numel * pd_dtype_size(t->dtype) == t->nbytes, "tensor %s size", t->name);
        FZ_CHECK(t->nbytes <= data_section, "tensor %s larger than the data section", t->name);
        FZ_CHECK(pd_st_find(st, t->name) == t, "pd_st_find(%s)", t->name);
        total += t->nbytes;
        /* read every byte: outside the mapping this faults */
        volatile uint8_t acc = 0;
        for (size_t b = 0; b < t->nbytes; b++)
            acc ^= ((const uint8_t *)t->data)[b];
        (void)acc;
        if (t->nbytes <= (1u << 20) && t->dtype != PD_DT_I64 && t->dtype != PD_DT_I32 &&
            numel > 0) {
            float *out = malloc((size_t)numel * sizeof *out);
            if (out) {
                pd_st_to_f32(t, out);
                free(out);
            }
        }
    }
    FZ_CHECK(total <= data_section, "tensors overlap: %zu bytes in %zu", total, data_section);
    pd_st_close(&st);
    FZ_CHECK(st == NULL, "pd_st_close");
    close(fd);
    return 0;
}
