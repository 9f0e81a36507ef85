/*
 * A stand-in for libnvidia-ml.so.1 on machines without an NVIDIA GPU.
 *
 * It exports the NVML entry points crihook reaches through pynvml, with NVML's C signatures,
 * return codes and struct layouts, so the real pynvml loads it and calls it exactly as it calls the
 * driver's library. The GPUs, their NVLinks and the PCIe topology come from a JSON file named by
 * CRIHOOK_FAKE_NVML_CONFIG, read by nvmlInit*; see crihook/simnode/fakenvml.py for the schema.
 * Without the variable, `topology.json` beside the library itself is read: a program that only
 * gets the library's directory (a node pod mounting the driver's directory) sees the same node.
 *
 * Beyond NVML, two control functions for tests: fakeNvmlCallCount() (how many NVML calls were made,
 * to prove a cache made none) and fakeNvmlReload() (re-read the file while initialised, to change a
 * GPU's health under a running reporter). The process queries re-read the file themselves when it
 * changed, so another process (the demo, a test driving a daemon) can start and end GPU processes.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 32
#define MAX_LINKS 36 /* NVML_NVLINK_MAX_LINKS */
#define MAX_MIG 7    /* MIG device slots of an A100/H100: nvmlDeviceGetMaxMigDeviceCount in MIG mode */
#define NVLINK_DEVICE_TYPE_GPU 0
#define NVLINK_DEVICE_TYPE_SWITCH 2
#define ABSENT -1 /* a query the modelled GPU does not support: NVML_ERROR_NOT_SUPPORTED */
#define MAX_PROCS 64
#define NOT_AVAILABLE_UINT 0xFFFFFFFFu          /* NVML_VALUE_NOT_AVAILABLE as an unsigned int */
#define NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFull /* ... and as an unsigned long long */
#define PROC_COMPUTE 1
#define PROC_GRAPHICS 2

/* nvmlPciInfo_t as NVML 9.0+ lays it out (pynvml's nvmlPciInfo_t). */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

/* nvmlProcessInfo_v1_t: what the unversioned nvmlDevice*RunningProcesses entry points fill. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* nvmlProcessInfo_t (v2 and v3 share the layout; pynvml's c_nvmlProcessInfo_v2_t): the _v2 and _v3
 * entry points fill it. The instance ids are NVML_VALUE_NOT_AVAILABLE outside MIG mode. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* nvmlProcessUtilizationSample_t (pynvml's c_nvmlProcessUtilizationSample_t). */
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp; /* CPU time in microseconds */
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

/* A process with a context on a GPU (or on one of its MIG devices). */
struct proc {
    unsigned int pid;
    unsigned long long used_memory; /* NOT_AVAILABLE_ULL when the file says null */
    int kinds;                      /* PROC_COMPUTE | PROC_GRAPHICS */
    int sm_util;                    /* ABSENT: the driver keeps no samples of it */
    int mem_util;
    int mig; /* the MIG slot it runs on, ABSENT on a GPU not in MIG mode */
};

struct link {
    int active;
    int remote_type;
    unsigned int version;
    char remote[32]; /* remote PCI address, 0000:bb:dd.f */
};

struct gpu {
    unsigned int index;
    unsigned int minor;
    char uuid[96];
    char name[96];
    unsigned long long memory_total;
    unsigned long long memory_used;
    char pci[32];
    unsigned int pci_device_id;
    unsigned int pci_subsystem_id;
    int mig_mode;              /* ABSENT, 0 or 1 */
    int retired_pages_pending; /* ABSENT, 0 or 1 */
    int row_remap_failure;     /* ABSENT, 0 or 1 */
    int cc_major, cc_minor;    /* CUDA compute capability; ABSENT when not given */
    int lost;
    int nlinks; /* links the GPU has; 0 = no NVLink at all */
    struct link links[MAX_LINKS];
    char mig[MAX_MIG][96]; /* MIG device UUIDs by slot, "" for an empty slot */
    int nprocs;
    struct proc procs[MAX_PROCS];
};

/* A MIG device handle: NVML hands these out as device handles of their own. */
struct mig {
    struct gpu *parent;
    unsigned int slot;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int refcount;
static char driver_version[80];
static int gpu_count;
static struct gpu gpus[MAX_GPUS]; /* fixed storage: handles stay valid across reloads */
static struct mig migs[MAX_GPUS][MAX_MIG];
static int pcie_level[MAX_GPUS][MAX_GPUS];
static unsigned long calls;
static struct timespec loaded_mtime; /* of the file last loaded, to see it change */
static off_t loaded_size;

/* ---- a small JSON reader: enough for the topology files, strict about what it accepts ---- */

enum jtype { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ };

typedef struct jv {
    enum jtype t;
    double num;
    char *str;
    int n;
    char **keys;
    struct jv **items;
} jv;

struct reader {
    const char *p;
    const char *err;
};

static void skip_ws(struct reader *r) {
    while (*r->p && isspace((unsigned char)*r->p)) r->p++;
}

static jv *jnew(enum jtype t) {
    jv *v = calloc(1, sizeof *v);
    v->t = t;
    return v;
}

static void jfree(jv *v) {
    if (!v) return;
    for (int i = 0; i < v->n; i++) {
        jfree(v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->str);
    free(v);
}

static char *parse_string(struct reader *r) {
    if (*r->p != '"') {
        r->err = "expected a string";
        return NULL;
    }
    r->p++;
    size_t cap = 16, len = 0;
    char *out = malloc(cap);
    while (*r->p && *r->p != '"') {
        char c = *r->p++;
        if (c == '\\') {
            c = *r->p++;
            switch (c) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case '"': case '\\': case '/': break;
            default:
                r->err = "unsupported escape in string";
                free(out);
                return NULL;
            }
        }
        if (len + 2 > cap) out = realloc(out, cap *= 2);
        out[len++] = c;
    }
    if (*r->p != '"') {
        r->err = "unterminated string";
        free(out);
        return NULL;
    }
    r->p++;
    out[len] = 0;
    return out;
}

static jv *parse_value(struct reader *r);

static jv *parse_container(struct reader *r, enum jtype t) {
    char close = t == J_ARR ? ']' : '}';
    jv *v = jnew(t);
    r->p++;
    skip_ws(r);
    if (*r->p == close) {
        r->p++;
        return v;
    }
    for (;;) {
        char *key = NULL;
        skip_ws(r);
        if (t == J_OBJ) {
            key = parse_string(r);
            if (!key) break;
            skip_ws(r);
            if (*r->p != ':') {
                r->err = "expected ':'";
                free(key);
                break;
            }
            r->p++;
        }
        jv *item = parse_value(r);
        if (!item) {
            free(key);
            break;
        }
        v->items = realloc(v->items, sizeof *v->items * (v->n + 1));
        if (t == J_OBJ) v->keys = realloc(v->keys, sizeof *v->keys * (v->n + 1));
        v->items[v->n] = item;
        if (t == J_OBJ) v->keys[v->n] = key;
        v->n++;
        skip_ws(r);
        if (*r->p == ',') {
            r->p++;
            continue;
        }
        if (*r->p == close) {
            r->p++;
            return v;
        }
        r->err = "expected ',' or a closing bracket";
        break;
    }
    jfree(v);
    return NULL;
}

static jv *parse_value(struct reader *r) {
    skip_ws(r);
    if (*r->p == '{') return parse_container(r, J_OBJ);
    if (*r->p == '[') return parse_container(r, J_ARR);
    if (*r->p == '"') {
        char *s = parse_string(r);
        if (!s) return NULL;
        jv *v = jnew(J_STR);
        v->str = s;
        return v;
    }
    static const struct { const char *word; enum jtype t; double num; } words[] = {
        {"true", J_BOOL, 1}, {"false", J_BOOL, 0}, {"null", J_NULL, 0}};
    for (size_t i = 0; i < sizeof words / sizeof *words; i++) {
        size_t n = strlen(words[i].word);
        if (strncmp(r->p, words[i].word, n) == 0) {
            r->p += n;
            jv *v = jnew(words[i].t);
            v->num = words[i].num;
            return v;
        }
    }
    char *end;
    double d = strtod(r->p, &end);
    if (end == r->p) {
        r->err = "unexpected character";
        return NULL;
    }
    r->p = end;
    jv *v = jnew(J_NUM);
    v->num = d;
    return v;
}

static jv *jget(const jv *obj, const char *key) {
    if (!obj || obj->t != J_OBJ) return NULL;
    for (int i = 0; i < obj->n; i++)
        if (strcmp(obj->keys[i], key) == 0) return obj->items[i];
    return NULL;
}

/* ---- the topology file ---- */

static int load_error(const char *path, const char *what) {
    fprintf(stderr, "fakenvml: %s: %s\n", path, what);
    return NVML_ERROR_UNKNOWN;
}

static int copy_str(char *dst, size_t size, const jv *v) {
    if (!v || v->t != J_STR || strlen(v->str) >= size) return -1;
    strcpy(dst, v->str);
    return 0;
}

/* A tri-state field: missing or null means the GPU does not support the query. */
static int tri(const jv *v) {
    return (!v || v->t == J_NULL) ? ABSENT : (int)v->num;
}

static int load_gpu(struct gpu *g, unsigned int index, const jv *o) {
    memset(g, 0, sizeof *g);
    g->index = index;
    jv *minor = jget(o, "minor"), *mem = jget(o, "memory_total");
    if (!minor || minor->t != J_NUM || !mem || mem->t != J_NUM) return -1;
    g->minor = (unsigned int)minor->num;
    g->memory_total = (unsigned long long)mem->num;
    jv *used = jget(o, "memory_used");
    g->memory_used = used ? (unsigned long long)used->num : 0;
    if (copy_str(g->uuid, sizeof g->uuid, jget(o, "uuid")) || copy_str(g->name, sizeof g->name, jget(o, "name")) ||
        copy_str(g->pci, sizeof g->pci, jget(o, "pci_bus_id")))
        return -1;
    jv *devid = jget(o, "pci_device_id"), *subsys = jget(o, "pci_subsystem_id");
    g->pci_device_id = devid ? (unsigned int)devid->num : 0;
    g->pci_subsystem_id = subsys ? (unsigned int)subsys->num : 0;
    g->mig_mode = tri(jget(o, "mig_mode"));
    g->retired_pages_pending = tri(jget(o, "retired_pages_pending"));
    g->row_remap_failure = tri(jget(o, "row_remap_failure"));
    jv *cc = jget(o, "cuda_capability"); /* [major, minor] */
    g->cc_major = g->cc_minor = ABSENT;
    if (cc && cc->t != J_NULL) {
        if (cc->t != J_ARR || cc->n != 2 || cc->items[0]->t != J_NUM || cc->items[1]->t != J_NUM) return -1;
        g->cc_major = (int)cc->items[0]->num;
        g->cc_minor = (int)cc->items[1]->num;
    }
    jv *lost = jget(o, "lost");
    g->lost = lost ? (int)lost->num : 0;
    /* MIG devices by slot, null for an empty one: NVML answers NOT_FOUND for it */
    jv *mig = jget(o, "mig_devices");
    if (mig) {
        if (mig->t != J_ARR || mig->n > MAX_MIG) return -1;
        for (int j = 0; j < mig->n; j++)
            if (mig->items[j]->t != J_NULL && copy_str(g->mig[j], sizeof g->mig[j], mig->items[j])) return -1;
    }
    jv *procs = jget(o, "processes");
    if (procs) {
        if (procs->t != J_ARR || procs->n > MAX_PROCS) return -1;
        for (int i = 0; i < procs->n; i++) {
            const jv *p = procs->items[i];
            jv *pid = jget(p, "pid"), *used = jget(p, "used_memory"), *kind = jget(p, "type");
            if (!pid || pid->t != J_NUM || !used || (used->t != J_NUM && used->t != J_NULL)) return -1;
            struct proc *dst = &g->procs[g->nprocs++];
            dst->pid = (unsigned int)pid->num;
            dst->used_memory = used->t == J_NULL ? NOT_AVAILABLE_ULL : (unsigned long long)used->num;
            const char *k = kind && kind->t == J_STR ? kind->str : "compute";
            dst->kinds = strcmp(k, "graphics") == 0 ? PROC_GRAPHICS
                         : strcmp(k, "both") == 0   ? PROC_COMPUTE | PROC_GRAPHICS
                                                    : PROC_COMPUTE;
            dst->sm_util = tri(jget(p, "sm_util"));
            dst->mem_util = tri(jget(p, "mem_util"));
            dst->mig = tri(jget(p, "mig"));
            if (dst->mig != ABSENT && (dst->mig < 0 || dst->mig >= MAX_MIG || !g->mig[dst->mig][0])) return -1;
        }
    }
    jv *version = jget(o, "nvlink_version"), *links = jget(o, "nvlinks");
    if (!links) return 0;
    if (links->t != J_ARR || !version) return -1;
    /* Each entry stands for `count` consecutive links to the same remote device. */
    for (int i = 0; i < links->n; i++) {
        const jv *l = links->items[i];
        jv *count = jget(l, "count"), *type = jget(l, "type"), *active = jget(l, "active");
        int n = count ? (int)count->num : 1;
        if (!type || type->t != J_STR || n < 0 || g->nlinks + n > MAX_LINKS) return -1;
        for (int k = 0; k < n; k++) {
            struct link *dst = &g->links[g->nlinks++];
            if (copy_str(dst->remote, sizeof dst->remote, jget(l, "remote"))) return -1;
            dst->active = active ? (int)active->num : 1;
            dst->version = (unsigned int)version->num;
            dst->remote_type = strcmp(type->str, "switch") == 0 ? NVLINK_DEVICE_TYPE_SWITCH : NVLINK_DEVICE_TYPE_GPU;
        }
    }
    return 0;
}

/* The topology file: CRIHOOK_FAKE_NVML_CONFIG, else topology.json in this library's directory;
 * NULL when neither can be named. */
static const char *config_path(void) {
    static char beside[4096];
    const char *path = getenv("CRIHOOK_FAKE_NVML_CONFIG");
    if (path && *path) return path;
    Dl_info info;
    if (!dladdr((void *)config_path, &info) || !info.dli_fname) return NULL;
    const char *slash = strrchr(info.dli_fname, '/');
    int dir = slash ? (int)(slash - info.dli_fname) : 1;
    const char *base = slash ? info.dli_fname : ".";
    if (snprintf(beside, sizeof beside, "%.*s/topology.json", dir, base) >= (int)sizeof beside) return NULL;
    return beside;
}

/* Returns an NVML code: what nvmlInit answers. Call with `lock` held. */
static int load_config(void) {
    const char *path = config_path();
    if (!path) return load_error("CRIHOOK_FAKE_NVML_CONFIG", "not set and the library's directory unknown");
    FILE *f = fopen(path, "rb");
    if (!f) return load_error(path, "can not be opened");
    struct stat st;
    if (fstat(fileno(f), &st) == 0) {
        loaded_mtime = st.st_mtim;
        loaded_size = st.st_size;
    }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    rewind(f);
    char *text = malloc(size + 1);
    size_t got = fread(text, 1, size, f);
    fclose(f);
    text[got] = 0;
    struct reader r = {text, NULL};
    jv *root = parse_value(&r);
    free(text);
    if (!root || root->t != J_OBJ) {
        jfree(root);
        return load_error(path, r.err ? r.err : "the top level is not an object");
    }
    int rc = NVML_SUCCESS;
    jv *init_error = jget(root, "init_error"), *list = jget(root, "gpus"), *levels = jget(root, "pcie_levels");
    if (init_error && (int)init_error->num != NVML_SUCCESS) {
        rc = (int)init_error->num;
    } else if (copy_str(driver_version, sizeof driver_version, jget(root, "driver_version"))) {
        rc = load_error(path, "driver_version missing or too long");
    } else if (!list || list->t != J_ARR || list->n > MAX_GPUS) {
        rc = load_error(path, "gpus missing or more than 32");
    } else if (!levels || levels->t != J_ARR || levels->n != list->n) {
        rc = load_error(path, "pcie_levels must be a square matrix, one row per GPU");
    } else {
        gpu_count = list->n;
        for (int i = 0; i < list->n && rc == NVML_SUCCESS; i++) {
            const jv *row = levels->items[i];
            if (load_gpu(&gpus[i], (unsigned int)i, list->items[i]) != 0)
                rc = load_error(path, "a GPU entry lacks a field or has one of the wrong type");
            else if (row->t != J_ARR || row->n != list->n)
                rc = load_error(path, "pcie_levels must be a square matrix, one row per GPU");
            else
                for (int j = 0; j < list->n; j++) pcie_level[i][j] = (int)row->items[j]->num;
        }
    }
    if (rc != NVML_SUCCESS) gpu_count = 0; /* a failed (re)load leaves no stale GPUs behind */
    jfree(root);
    return rc;
}

/* ---- NVML entry points ---- */

#define ENTER()                                  \
    pthread_mutex_lock(&lock);                   \
    calls++;                                     \
    if (refcount == 0) {                         \
        pthread_mutex_unlock(&lock);             \
        return NVML_ERROR_UNINITIALIZED;         \
    }
#define LEAVE(rc)                  \
    do {                           \
        pthread_mutex_unlock(&lock); \
        return (rc);               \
    } while (0)

static struct gpu *as_gpu(void *handle) {
    struct gpu *g = handle;
    return (g >= gpus && g < gpus + gpu_count) ? g : NULL;
}

/* Unlike the driver, every init re-reads the file, so a test that forgot to shut down does not
 * leave its topology to the next one. */
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    calls++;
    int rc = load_config();
    if (rc == NVML_SUCCESS) refcount++;
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    ENTER();
    refcount--;
    LEAVE(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t put_string(char *dst, unsigned int length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER();
    LEAVE(put_string(version, length, driver_version));
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER();
    if (!count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *count = (unsigned int)gpu_count;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    ENTER();
    if (!device || index >= (unsigned int)gpu_count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *device = &gpus[index];
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, void **device) {
    ENTER();
    if (!uuid || !device) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < gpu_count; i++) {
        if (strcmp(gpus[i].uuid, uuid) == 0) {
            *device = &gpus[i];
            LEAVE(NVML_SUCCESS);
        }
    }
    LEAVE(NVML_ERROR_NOT_FOUND);
}

/* Identity (index, minor, UUID, name, PCI) is what the driver caches at probe time, so it stays
 * readable for a GPU that fell off the bus; live state (memory, health, links, MIG) does not. */
#define DEVICE(handle, out)                                        \
    ENTER();                                                       \
    struct gpu *g = as_gpu(handle);                                \
    if (!g || !(out)) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
#define LIVE_DEVICE(handle, out) \
    DEVICE(handle, out)          \
    if (g->lost) LEAVE(NVML_ERROR_GPU_IS_LOST);

nvmlReturn_t nvmlDeviceGetIndex(void *device, unsigned int *index) {
    DEVICE(device, index);
    *index = g->index;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(void *device, unsigned int *minor) {
    DEVICE(device, minor);
    *minor = g->minor;
    LEAVE(NVML_SUCCESS);
}

static struct mig *as_mig(void *handle) {
    struct mig *m = handle;
    if (m < &migs[0][0] || m >= &migs[0][0] + MAX_GPUS * MAX_MIG || !as_gpu(m->parent)) return NULL;
    return m->parent->mig[m->slot][0] ? m : NULL;
}

nvmlReturn_t nvmlDeviceGetUUID(void *device, char *uuid, unsigned int length) {
    ENTER();
    struct mig *m = as_mig(device);
    if (m) LEAVE(put_string(uuid, length, m->parent->mig[m->slot]));
    struct gpu *g = as_gpu(device);
    if (!g) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    LEAVE(put_string(uuid, length, g->uuid));
}

nvmlReturn_t nvmlDeviceGetName(void *device, char *name, unsigned int length) {
    DEVICE(device, name);
    LEAVE(put_string(name, length, g->name));
}

static void fill_pci(nvmlPciInfo_t *info, const char *address, unsigned int device_id, unsigned int subsystem_id) {
    unsigned int domain = 0, bus = 0, dev = 0, fn = 0;
    sscanf(address, "%x:%x:%x.%x", &domain, &bus, &dev, &fn);
    memset(info, 0, sizeof *info);
    info->domain = domain;
    info->bus = bus;
    info->device = dev;
    info->pciDeviceId = device_id;
    info->pciSubSystemId = subsystem_id;
    snprintf(info->busIdLegacy, sizeof info->busIdLegacy, "%04X:%02X:%02X.%X", domain, bus, dev, fn);
    snprintf(info->busId, sizeof info->busId, "%08X:%02X:%02X.%X", domain, bus, dev, fn);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(void *device, int *major, int *minor) {
    DEVICE(device, major);
    if (!minor) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (g->cc_major == ABSENT) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *major = g->cc_major;
    *minor = g->cc_minor;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(void *device, nvmlPciInfo_t *pci) {
    DEVICE(device, pci);
    fill_pci(pci, g->pci, g->pci_device_id, g->pci_subsystem_id);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *memory) {
    LIVE_DEVICE(device, memory);
    /* the driver's own reservation (memory_used) and what its processes hold */
    unsigned long long used = g->memory_used;
    for (int i = 0; i < g->nprocs; i++)
        if (g->procs[i].used_memory != NOT_AVAILABLE_ULL) used += g->procs[i].used_memory;
    if (used > g->memory_total) used = g->memory_total;
    memory->total = g->memory_total;
    memory->used = used;
    memory->free = g->memory_total - used;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigMode(void *device, unsigned int *current, unsigned int *pending) {
    LIVE_DEVICE(device, current);
    if (!pending) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (g->mig_mode == ABSENT) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *current = *pending = (unsigned int)g->mig_mode;
    LEAVE(NVML_SUCCESS);
}

/* Zero when MIG is not supported or not enabled, as NVML documents. */
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(void *device, unsigned int *count) {
    LIVE_DEVICE(device, count);
    *count = g->mig_mode == 1 ? MAX_MIG : 0;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(void *device, unsigned int index, void **mig) {
    LIVE_DEVICE(device, mig);
    if (index >= MAX_MIG) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (g->mig_mode != 1 || !g->mig[index][0]) LEAVE(NVML_ERROR_NOT_FOUND);
    struct mig *m = &migs[g->index][index];
    m->parent = g;
    m->slot = index;
    *mig = m;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(void *device, unsigned int *pending) {
    LIVE_DEVICE(device, pending);
    if (g->retired_pages_pending == ABSENT) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *pending = (unsigned int)g->retired_pages_pending;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(void *device, unsigned int *corr, unsigned int *unc, unsigned int *pending,
                                       unsigned int *failure) {
    LIVE_DEVICE(device, corr);
    if (!unc || !pending || !failure) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (g->row_remap_failure == ABSENT) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *corr = *pending = 0;
    *unc = *failure = (unsigned int)g->row_remap_failure;
    LEAVE(NVML_SUCCESS);
}

/* Link numbers past NVML_NVLINK_MAX_LINKS are invalid; links this GPU does not have, unsupported. */
#define LINK(device, link, out)                           \
    LIVE_DEVICE(device, out);                             \
    if ((link) >= MAX_LINKS) LEAVE(NVML_ERROR_INVALID_ARGUMENT); \
    if ((int)(link) >= g->nlinks) LEAVE(NVML_ERROR_NOT_SUPPORTED); \
    const struct link *l = &g->links[link];

nvmlReturn_t nvmlDeviceGetNvLinkState(void *device, unsigned int link, unsigned int *active) {
    LINK(device, link, active);
    *active = (unsigned int)l->active;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkVersion(void *device, unsigned int link, unsigned int *version) {
    LINK(device, link, version);
    *version = l->version;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(void *device, unsigned int link, nvmlPciInfo_t *pci) {
    LINK(device, link, pci);
    unsigned int device_id = 0;
    for (int i = 0; i < gpu_count; i++)
        if (strcasecmp(gpus[i].pci, l->remote) == 0) device_id = gpus[i].pci_device_id;
    fill_pci(pci, l->remote, device_id, 0);
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(void *device, unsigned int link, unsigned int *type) {
    LINK(device, link, type);
    *type = (unsigned int)l->remote_type;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(void *device1, void *device2, unsigned int *level) {
    ENTER();
    struct gpu *a = as_gpu(device1), *b = as_gpu(device2);
    if (!a || !b || !level) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *level = (unsigned int)pcie_level[a->index][b->index];
    LEAVE(NVML_SUCCESS);
}

/* ---- processes ---- */

/* Re-read the file when it changed since it was loaded: processes come and go under a running
 * daemon. Returns what load_config does (a file it refuses leaves no GPUs). Call with `lock` held. */
static int reload_if_changed(void) {
    const char *path = config_path();
    struct stat st;
    if (!path || stat(path, &st) != 0) return NVML_SUCCESS;
    if (st.st_mtim.tv_sec == loaded_mtime.tv_sec && st.st_mtim.tv_nsec == loaded_mtime.tv_nsec &&
        st.st_size == loaded_size)
        return NVML_SUCCESS;
    return load_config();
}

/* The device a handle names: a GPU (slot ABSENT) or one of its MIG devices. */
static struct gpu *process_device(void *handle, int *slot) {
    struct mig *m = as_mig(handle);
    if (m) {
        *slot = (int)m->slot;
        return m->parent;
    }
    *slot = ABSENT;
    return as_gpu(handle);
}

/* What every process query starts with: the device the handle names (`g`, and `slot` for a MIG
 * device), the file re-read if it changed. */
#define PROCESS_DEVICE(device, count)                 \
    ENTER();                                          \
    if (!(count)) LEAVE(NVML_ERROR_INVALID_ARGUMENT); \
    int rc = reload_if_changed();                     \
    if (rc != NVML_SUCCESS) LEAVE(rc);                \
    int slot;                                         \
    struct gpu *g = process_device(device, &slot);    \
    if (!g) LEAVE(NVML_ERROR_INVALID_ARGUMENT);       \
    if (g->lost) LEAVE(NVML_ERROR_GPU_IS_LOST);

/* The processes of `kind` on a device: all of a GPU's (in MIG mode too, with their instance ids,
 * as NVML answers a privileged caller), or one MIG device's. Fills `out` as v1 (16-byte) or v2/v3
 * (24-byte) entries. With too small a buffer (or none), says how many there are. */
static nvmlReturn_t running_processes(void *device, unsigned int *count, void *out, int kind, int v1) {
    PROCESS_DEVICE(device, count);
    unsigned int n = 0;
    for (int i = 0; i < g->nprocs; i++)
        if ((g->procs[i].kinds & kind) && (slot == ABSENT || g->procs[i].mig == slot)) n++;
    if (n == 0) {
        *count = 0;
        LEAVE(NVML_SUCCESS);
    }
    if (!out || *count < n) {
        *count = n;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    unsigned int k = 0;
    for (int i = 0; i < g->nprocs; i++) {
        const struct proc *p = &g->procs[i];
        if (!(p->kinds & kind) || (slot != ABSENT && p->mig != slot)) continue;
        if (v1) {
            nvmlProcessInfo_v1_t *e = (nvmlProcessInfo_v1_t *)out + k++;
            e->pid = p->pid;
            e->usedGpuMemory = p->used_memory;
        } else {
            nvmlProcessInfo_t *e = (nvmlProcessInfo_t *)out + k++;
            e->pid = p->pid;
            e->usedGpuMemory = p->used_memory;
            e->gpuInstanceId = p->mig == ABSENT ? NOT_AVAILABLE_UINT : (unsigned int)p->mig;
            e->computeInstanceId = p->mig == ABSENT ? NOT_AVAILABLE_UINT : 0;
        }
    }
    *count = n;
    LEAVE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned int *count, nvmlProcessInfo_t *infos) {
    return running_processes(device, count, infos, PROC_COMPUTE, 0);
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(void *device, unsigned int *count, nvmlProcessInfo_t *infos) {
    return running_processes(device, count, infos, PROC_COMPUTE, 0);
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(void *device, unsigned int *count, nvmlProcessInfo_v1_t *infos) {
    return running_processes(device, count, infos, PROC_COMPUTE, 1);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(void *device, unsigned int *count, nvmlProcessInfo_t *infos) {
    return running_processes(device, count, infos, PROC_GRAPHICS, 0);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(void *device, unsigned int *count, nvmlProcessInfo_t *infos) {
    return running_processes(device, count, infos, PROC_GRAPHICS, 0);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(void *device, unsigned int *count, nvmlProcessInfo_v1_t *infos) {
    return running_processes(device, count, infos, PROC_GRAPHICS, 1);
}

/* One sample per process with a utilisation, stamped now (so every read finds a fresh one newer
 * than the last it saw). Not supported on MIG devices or a GPU in MIG mode, as on the driver; no
 * sample newer than lastSeenTimeStamp is NOT_FOUND. pynvml sizes the buffer with a first call that
 * passes none and expects INSUFFICIENT_SIZE. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(void *device, nvmlProcessUtilizationSample_t *samples,
                                             unsigned int *count, unsigned long long lastSeenTimeStamp) {
    PROCESS_DEVICE(device, count);
    if (slot != ABSENT || g->mig_mode == 1) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned long long now = (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000;
    unsigned int n = 0;
    for (int i = 0; i < g->nprocs; i++)
        if (g->procs[i].sm_util != ABSENT) n++;
    if (n == 0 || now <= lastSeenTimeStamp) LEAVE(NVML_ERROR_NOT_FOUND);
    if (!samples || *count < n) {
        *count = n;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    unsigned int k = 0;
    for (int i = 0; i < g->nprocs; i++) {
        const struct proc *p = &g->procs[i];
        if (p->sm_util == ABSENT) continue;
        nvmlProcessUtilizationSample_t *s = &samples[k++];
        memset(s, 0, sizeof *s);
        s->pid = p->pid;
        s->timeStamp = now;
        s->smUtil = (unsigned int)p->sm_util;
        s->memUtil = p->mem_util == ABSENT ? 0 : (unsigned int)p->mem_util;
    }
    *count = n;
    LEAVE(NVML_SUCCESS);
}

/* ---- test controls ---- */

unsigned long fakeNvmlCallCount(void) {
    pthread_mutex_lock(&lock);
    unsigned long n = calls;
    pthread_mutex_unlock(&lock);
    return n;
}

int fakeNvmlReload(void) {
    pthread_mutex_lock(&lock);
    int rc = load_config();
    pthread_mutex_unlock(&lock);
    return rc;
}
