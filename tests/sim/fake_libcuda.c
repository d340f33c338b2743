/* A fake libcuda.so.1 for the simulated hosts: the entry points of the CUDA driver API that
 * zeromib.gpu's smoke test (plugins/module_utils/_cuda_smoke.py) and cuda_version
 * (cuDriverGetVersion) call, with the real signatures and CUresult codes (cuda.h of CUDA 12/13).
 *
 * Driven by a config file, read at every cuInit: $FAKE_LIBCUDA_CONFIG, else
 * /run/nvidia-sim/libcuda.conf (the simulated host's state dir). One directive a line:
 *     device 0000:00:06.0      a GPU by PCI bus id (any domain width); none listed: every id is one
 *     fail cuCtxCreate 802     that call returns that CUresult
 *     hang cuCtxSynchronize    that call never returns (sleeps until killed)
 *     free_mib 1000            what cuMemGetInfo says is free (default 143771, an H200)
 * Every call is appended to $FAKE_LIBCUDA_LOG, else /run/nvidia-sim/libcuda.log, as
 * "<pid> <call> <argument>": tests prove from it what ran (and that check mode ran nothing).
 *
 * Like the real library: device calls before cuInit return CUDA_ERROR_NOT_INITIALIZED (3),
 * memory calls without a current context CUDA_ERROR_INVALID_CONTEXT (201), an unknown bus id
 * CUDA_ERROR_INVALID_DEVICE (101), an allocation over the free memory CUDA_ERROR_OUT_OF_MEMORY (2),
 * cuGetErrorName of an unknown code CUDA_ERROR_INVALID_VALUE (1) with the string untouched.
 *
 * Built by the tests: cc -shared -fPIC -o libcuda.so.1 fake_libcuda.c (tests/sim/fake_libcuda.py).
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

#define MAX_ITEMS 64

static struct {
    char devices[MAX_ITEMS][32];
    int n_devices;
    char fail_call[MAX_ITEMS][40];
    int fail_code[MAX_ITEMS];
    int n_fail;
    char hang_call[MAX_ITEMS][40];
    int n_hang;
    unsigned long long free_bytes;
} cfg;

static int initialized;
static int context_live;
static int current_device = -1;
static unsigned long long allocated;
static int context_token;

static const struct { int code; const char *name; const char *text; } ERRORS[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {46, "CUDA_ERROR_DEVICES_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {214, "CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {802, "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"},
    {803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static const char *path_of(const char *env, const char *fallback) {
    const char *value = getenv(env);
    return value && *value ? value : fallback;
}

static void log_call(const char *call, const char *arg) {
    FILE *f = fopen(path_of("FAKE_LIBCUDA_LOG", "/run/nvidia-sim/libcuda.log"), "a");
    if (!f)
        return;
    fprintf(f, "%d %s %s\n", (int)getpid(), call, arg ? arg : "-");
    fclose(f);
}

static void load_config(void) {
    memset(&cfg, 0, sizeof(cfg));
    cfg.free_bytes = 143771ULL << 20;
    FILE *f = fopen(path_of("FAKE_LIBCUDA_CONFIG", "/run/nvidia-sim/libcuda.conf"), "r");
    if (!f)
        return;
    char line[256], word[40], arg[40];
    int code;
    while (fgets(line, sizeof(line), f)) {
        if (sscanf(line, "device %31s", arg) == 1 && cfg.n_devices < MAX_ITEMS)
            strcpy(cfg.devices[cfg.n_devices++], arg);
        else if (sscanf(line, "fail %39s %d", word, &code) == 2 && cfg.n_fail < MAX_ITEMS) {
            strcpy(cfg.fail_call[cfg.n_fail], word);
            cfg.fail_code[cfg.n_fail++] = code;
        } else if (sscanf(line, "hang %39s", word) == 1 && cfg.n_hang < MAX_ITEMS)
            strcpy(cfg.hang_call[cfg.n_hang++], word);
        else if (sscanf(line, "free_mib %39s", arg) == 1)
            cfg.free_bytes = strtoull(arg, NULL, 10) << 20;
    }
    fclose(f);
}

/* The configured fault of a call: hangs here, or returns its CUresult (0: none). */
static CUresult fault(const char *call) {
    for (int i = 0; i < cfg.n_hang; i++)
        if (strcmp(cfg.hang_call[i], call) == 0)
            for (;;)
                pause();
    for (int i = 0; i < cfg.n_fail; i++)
        if (strcmp(cfg.fail_call[i], call) == 0)
            return cfg.fail_code[i];
    return 0;
}

/* "00000000:18:00.0" and "0000:18:00.0" alike: the part after the domain, lower case. */
static void canonical(const char *bus, char *out, size_t size) {
    const char *colon = strchr(bus, ':');
    const char *rest = colon && strchr(colon + 1, ':') ? colon + 1 : bus;
    size_t i = 0;
    for (; rest[i] && i + 1 < size; i++)
        out[i] = (char)tolower((unsigned char)rest[i]);
    out[i] = 0;
}

CUresult cuDriverGetVersion(int *version) {
    log_call("cuDriverGetVersion", NULL);
    if (!version)
        return 1;
    *version = 13000;
    return 0;
}

CUresult cuInit(unsigned int flags) {
    (void)flags;
    load_config();
    log_call("cuInit", NULL);
    CUresult rc = fault("cuInit");
    if (rc == 0)
        initialized = 1;
    return rc;
}

CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *bus) {
    log_call("cuDeviceGetByPCIBusId", bus);
    if (!initialized)
        return 3;
    if (!dev || !bus)
        return 1;
    CUresult rc = fault("cuDeviceGetByPCIBusId");
    if (rc)
        return rc;
    if (cfg.n_devices == 0) {
        *dev = 0;
        return 0;
    }
    char want[32], have[32];
    canonical(bus, want, sizeof(want));
    for (int i = 0; i < cfg.n_devices; i++) {
        canonical(cfg.devices[i], have, sizeof(have));
        if (strcmp(want, have) == 0) {
            *dev = i;
            return 0;
        }
    }
    return 101;
}

CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned int flags, CUdevice dev) {
    char arg[16];
    (void)flags;
    snprintf(arg, sizeof(arg), "%d", dev);
    log_call("cuCtxCreate", arg);
    if (!initialized)
        return 3;
    if (!ctx)
        return 1;
    CUresult rc = fault("cuCtxCreate");
    if (rc)
        return rc;
    context_live = 1;
    current_device = dev;
    *ctx = &context_token;
    return 0;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    log_call("cuMemGetInfo", NULL);
    if (!context_live)
        return 201;
    CUresult rc = fault("cuMemGetInfo");
    if (rc)
        return rc;
    *free_bytes = (size_t)(cfg.free_bytes - allocated);
    *total = (size_t)(143771ULL << 20);
    return 0;
}

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t size) {
    char arg[32];
    snprintf(arg, sizeof(arg), "%zu", size);
    log_call("cuMemAlloc", arg);
    if (!context_live)
        return 201;
    CUresult rc = fault("cuMemAlloc");
    if (rc)
        return rc;
    if (size == 0 || !ptr)
        return 1;
    if (size > cfg.free_bytes - allocated)
        return 2;
    allocated += size;
    *ptr = 0x7f0000000000ULL;
    return 0;
}

CUresult cuMemsetD8_v2(CUdeviceptr ptr, unsigned char value, size_t n) {
    char arg[48];
    snprintf(arg, sizeof(arg), "0x%02x:%zu", value, n);
    log_call("cuMemsetD8", arg);
    if (!context_live)
        return 201;
    if (!ptr || n > allocated)
        return 1;
    return fault("cuMemsetD8");
}

CUresult cuCtxSynchronize(void) {
    log_call("cuCtxSynchronize", NULL);
    if (!context_live)
        return 201;
    return fault("cuCtxSynchronize");
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    log_call("cuMemFree", NULL);
    if (!context_live)
        return 201;
    if (!ptr)
        return 1;
    CUresult rc = fault("cuMemFree");
    if (rc)
        return rc;
    allocated = 0;
    return 0;
}

CUresult cuCtxDestroy_v2(CUcontext ctx) {
    log_call("cuCtxDestroy", NULL);
    if (!context_live || ctx != &context_token)
        return 201;
    CUresult rc = fault("cuCtxDestroy");
    if (rc)
        return rc;
    context_live = 0;
    current_device = -1;
    allocated = 0;
    return 0;
}

static int error_index(CUresult code) {
    for (size_t i = 0; i < sizeof(ERRORS) / sizeof(ERRORS[0]); i++)
        if (ERRORS[i].code == code)
            return (int)i;
    return -1;
}

CUresult cuGetErrorName(CUresult code, const char **name) {
    int i = error_index(code);
    if (!name || i < 0)
        return 1;
    *name = ERRORS[i].name;
    return 0;
}

CUresult cuGetErrorString(CUresult code, const char **text) {
    int i = error_index(code);
    if (!text || i < 0)
        return 1;
    *text = ERRORS[i].text;
    return 0;
}
