/* Tensor element types: sizes, safetensors names, and conversion of a
 * checkpoint tensor to fp32. Names are those of the safetensors format
 * (huggingface/safetensors, safetensors/src/tensor.rs `Dtype`). */
#include "pd_model.h"

#include <string.h>

static const struct {
    const char *name;
    size_t size;
} dtype_info[PD_DT_COUNT] = {
    [PD_DT_F32] = {"F32", 4},         [PD_DT_BF16] = {"BF16", 2}, [PD_DT_F16] = {"F16", 2},
    [PD_DT_F8_E4M3] = {"F8_E4M3", 1}, [PD_DT_I64] = {"I64", 8},   [PD_DT_I32] = {"I32", 4},
};

size_t pd_dtype_size(pd_dtype dt) {
    if ((unsigned)dt >= PD_DT_COUNT)
        return 0;
    return dtype_info[dt].size;
}

const char *pd_dtype_name(pd_dtype dt) {
    if ((unsigned)dt >= PD_DT_COUNT)
        return "?";
    return dtype_info[dt].name;
}

pd_status pd_dtype_parse(const char *name, pd_dtype *dt_p) {
    for (int i = 0; i < PD_DT_COUNT; i++) {
        if (strcmp(name, dtype_info[i].name) == 0) {
            *dt_p = (pd_dtype)i;
            return PD_OK;
        }
    }
    return PD_ERR_UNSUPPORTED;
}

/* The data of a mapped tensor sits at 8 + header length + begin bytes into
 * its file, which need not be aligned for the element type (the header
 * length is only padded to 8 by writers that choose to), so elements are
 * loaded with memcpy. Checkpoints are little-endian, as is every host we
 * build for. */
void pd_st_to_f32(const pd_st_tensor *t, float *out) {
    const uint8_t *src = t->data;
    size_t esize = pd_dtype_size(t->dtype);
    size_t n = esize ? t->nbytes / esize : 0;
    switch (t->dtype) {
    case PD_DT_F32:
        if (n)
            memcpy(out, src, n * 4);
        break;
    case PD_DT_BF16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            out[i] = pd_bf16_to_f32(h);
        }
        break;
    case PD_DT_F16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            out[i] = pd_f16_to_f32(h);
        }
        break;
    case PD_DT_F8_E4M3: {
        const float *tab = pd_e4m3_table();
        for (size_t i = 0; i < n; i++)
            out[i] = tab[src[i]];
        break;
    }
    case PD_DT_I64:
        for (size_t i = 0; i < n; i++) {
            int64_t v;
            memcpy(&v, src + 8 * i, 8);
            out[i] = (float)v;
        }
        break;
    case PD_DT_I32:
        for (size_t i = 0; i < n; i++) {
            int32_t v;
            memcpy(&v, src + 4 * i, 4);
            out[i] = (float)v;
        }
        break;
    default:
        break;
    }
}
