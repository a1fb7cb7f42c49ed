/* The kv-index's hash -> row index in C: open addressing over 4-byte slots, probed linearly
 * from the hash's top 32 bits scaled to the table size. A slot holds row + 1 in its low
 * `row_bits` bits (as many as the columns' capacity needs) and, above them, as many bits of
 * the hash as are left (bits 8 and up: the low ones may be fixed by the shard) as a
 * fingerprint; 0 is an empty slot, all ones a tombstone. The hash is read from the row only
 * when the fingerprint agrees: without one, reading the rows of the occupied slots a probe
 * passes was 56% of a put's time (perf; a cache miss each at 10M rows).
 *
 * The columns and the slots are numpy arrays that Python allocates and resizes; `bind` hands
 * their addresses over after every change, and Python makes room (rows and slots) before a
 * `put`, which checks it was given enough. services/kv_index/row_index.py says what each
 * method means; native.py builds and loads this file.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "row_index.c writes little-endian columns as they are in memory: little-endian only"
#endif

#define EMPTY 0u
#define TOMBSTONE 0xFFFFFFFFu
#define MIXED_SIZES (-2)
#define NEEDS_ROOM (-3)

typedef struct {
    PyObject_HEAD
    uint64_t *hash;
    uint16_t *kind;
    uint32_t *file_id, *slot, *generation;
    uint16_t *access;
    long long capacity; /* rows the columns hold */
    uint32_t *slots;
    long long size, max_entries; /* slots; live + tombstone entries put may fill them to */
    int row_bits;
    uint32_t row_mask;
    const uint64_t *kind_bytes;
    long long num_kinds;
    long long num_rows, num_live, num_tombstones, used_bytes;
} Core;

/* StoredBlock's fields, read straight from their slots when a block is of that type. */
static const char *FIELD_NAMES[5] = {"block_hash", "file_id", "slot", "generation", "num_bytes"};
static PyObject *field_names[5];
static PyTypeObject *block_type;
static Py_ssize_t field_offsets[5];

/* The first slot probed for `h`: the hash scaled to [0, size) (any size, not only powers of
 * two, so the table can grow by less than 2x). */
static inline long long home(const Core *c, uint64_t h) {
    return (long long)(((unsigned __int128)h * (uint64_t)c->size) >> 64);
}

static inline uint32_t fingerprint(const Core *c, uint64_t h) {
    return (uint32_t)(((h >> 8) << c->row_bits) & ~(uint64_t)c->row_mask & 0xFFFFFFFFull);
}

static inline uint32_t entry(const Core *c, uint64_t h, long long row) {
    return fingerprint(c, h) | (uint32_t)(row + 1);
}

/* The row a live slot holds, or -1 for an empty slot or a tombstone. */
static inline long long row_of(const Core *c, uint32_t v) {
    return v == EMPTY || v == TOMBSTONE ? -1 : (long long)(v & c->row_mask) - 1;
}

static inline long long find(const Core *c, uint64_t h) {
    uint32_t fp = fingerprint(c, h);
    long long i = home(c, h);
    for (;;) {
        uint32_t v = c->slots[i];
        if (v == EMPTY) return -1;
        if (v != TOMBSTONE && (v & ~c->row_mask) == fp) {
            long long row = (long long)(v & c->row_mask) - 1;
            if (c->hash[row] == h) return row;
        }
        if (++i == c->size) i = 0;
    }
}

/* The row of `h`, or -1 with `*free` set to the slot an insert of `h` would take. */
static inline long long find_or_free(const Core *c, uint64_t h, long long *free) {
    uint32_t fp = fingerprint(c, h);
    long long i = home(c, h), first_tombstone = -1;
    for (;;) {
        uint32_t v = c->slots[i];
        if (v == EMPTY) {
            *free = first_tombstone >= 0 ? first_tombstone : i;
            return -1;
        }
        if (v == TOMBSTONE) {
            if (first_tombstone < 0) first_tombstone = i;
        } else if ((v & ~c->row_mask) == fp) {
            long long row = (long long)(v & c->row_mask) - 1;
            if (c->hash[row] == h) return row;
        }
        if (++i == c->size) i = 0;
    }
}

/* Start loading the slots `n` lookups read first: their misses overlap, where one lookup
 * after another would wait for each (at 10M rows a miss is a trip to DRAM). */
static void prefetch(const Core *c, const uint64_t *keys, Py_ssize_t n, Py_ssize_t stride) {
    for (Py_ssize_t b = 0; b < n; b++) __builtin_prefetch(&c->slots[home(c, keys[b * stride])]);
}

/* Index `row` (its hash not in the index yet) at the first free slot from its home; -1 with
 * RuntimeError if every slot is taken (the caller sized the slots too small). */
static inline int insert(Core *c, long long row) {
    uint64_t h = c->hash[row];
    long long i = home(c, h), probed = 0;
    while (c->slots[i] != EMPTY && c->slots[i] != TOMBSTONE) {
        if (++i == c->size) i = 0;
        if (++probed == c->size) {
            PyErr_SetString(PyExc_RuntimeError, "row index: no free slot");
            return -1;
        }
    }
    if (c->slots[i] == TOMBSTONE) c->num_tombstones--;
    c->slots[i] = entry(c, h, row);
    return 0;
}

static int bad_field(Py_ssize_t position, int field, PyObject *value) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "stored block %zd: %s %R is not an integer in [0, 2**%d)",
                 position, FIELD_NAMES[field], value ? value : Py_None, field ? 32 : 64);
    return -1;
}

/* The five fields of one block into `out`, checked; -1 with ValueError if one is bad. */
static int read_block(PyObject *block, Py_ssize_t position, uint64_t *out) {
    int direct = Py_TYPE(block) == block_type;
    for (int f = 0; f < 5; f++) {
        PyObject *value = direct ? *(PyObject **)((char *)block + field_offsets[f])
                                 : PyObject_GetAttr(block, field_names[f]);
        if (value == NULL || !PyLong_Check(value)) {
            int result = bad_field(position, f, value);
            if (!direct) Py_XDECREF(value);
            return result;
        }
        /* PyLong_AsUnsignedLong reads a 64-bit hash's digits in a loop; the LongLong variant
         * goes through a byte array, 7% of a put's time (perf). */
#if ULONG_MAX >= 0xFFFFFFFFFFFFFFFFull
        unsigned long long x = PyLong_AsUnsignedLong(value);
#else
        unsigned long long x = PyLong_AsUnsignedLongLong(value);
#endif
        int failed = (x == (unsigned long long)-1 && PyErr_Occurred()) || (f && x > 0xFFFFFFFFull);
        if (failed) bad_field(position, f, value);
        if (!direct) Py_DECREF(value);
        if (failed) return -1;
        out[f] = x;
    }
    return 0;
}

/* put(blocks, num_bytes, kind, tick, num_shards, shard_id) -> blocks owned, or MIXED_SIZES,
 * or NEEDS_ROOM (nothing applied either way): more rows or slots than the table reserved */
static PyObject *Core_put(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "put takes 6 arguments");
        return NULL;
    }
    unsigned long long num_bytes = PyLong_AsUnsignedLongLong(args[1]);
    long kind = PyLong_AsLong(args[2]);
    long tick = PyLong_AsLong(args[3]);
    unsigned long long num_shards = PyLong_AsUnsignedLongLong(args[4]);
    unsigned long long shard_id = PyLong_AsUnsignedLongLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (kind <= 0 || kind >= c->num_kinds || tick < 0 || tick > 0xFFFF || num_shards == 0) {
        PyErr_SetString(PyExc_ValueError, "put: kind, tick or num_shards out of range");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "put: blocks must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    /* Room for every block as a new one: rows, and slots below the load the table keeps. */
    if (c->num_rows + n > c->capacity || c->num_live + c->num_tombstones + n > c->max_entries) {
        Py_DECREF(seq);
        return PyLong_FromLong(NEEDS_ROOM);
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t *values = PyMem_Malloc((size_t)(n ? n : 1) * 5 * sizeof(uint64_t));
    if (values == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    long long result = 0;
    for (Py_ssize_t b = 0; b < n; b++) { /* every block checked before any is applied */
        if (read_block(items[b], b, values + 5 * b) < 0) {
            result = -1;
            goto done;
        }
        if (values[5 * b + 4] != num_bytes) result = MIXED_SIZES;
    }
    if (result == MIXED_SIZES) goto done;
    prefetch(c, values, n, 5);
    for (Py_ssize_t b = 0; b < n; b++) {
        const uint64_t *v = values + 5 * b;
        if (num_shards > 1 && v[0] % num_shards != shard_id) continue;
        long long free, row = find_or_free(c, v[0], &free);
        if (row >= 0) {
            c->used_bytes -= (long long)c->kind_bytes[c->kind[row]];
        } else {
            row = c->num_rows++;
            c->num_live++;
            if (c->slots[free] == TOMBSTONE) c->num_tombstones--;
            c->slots[free] = entry(c, v[0], row);
        }
        c->hash[row] = v[0];
        c->kind[row] = (uint16_t)kind;
        c->file_id[row] = (uint32_t)v[1];
        c->slot[row] = (uint32_t)v[2];
        c->generation[row] = (uint32_t)v[3];
        c->access[row] = (uint16_t)tick;
        c->used_bytes += (long long)num_bytes;
        result++;
    }
done:
    PyMem_Free(values);
    Py_DECREF(seq);
    return result == -1 ? NULL : PyLong_FromLongLong(result);
}

/* A contiguous buffer of `n` items of `itemsize` bytes (a numpy array), writable or not. */
static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->itemsize != itemsize) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "expected items of %zd bytes", itemsize);
        return -1;
    }
    return 0;
}

/* answer(keys: uint64[n], tick) -> (num_hits, block_hashes, kinds, file_ids, slots,
 * generations): a match in this tier. How many keys from the first are here in a row: a key
 * whose hash the row after the previous key's holds is that row (a chained hash names its
 * whole prefix, and a hash has one live row), any other is looked up. Their columns come
 * back as the bytes BlockLocations carries (little-endian: hashes u64, kinds u16, the rest
 * u32), written in one pass: through numpy (rows, then a gather or slice and a tobytes per
 * column) the same answer cost 2x as much. tick >= 0 also sets the rows' last access. */
static PyObject *Core_answer(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer keys;
    if (nargs != 2 || get_buffer(args[0], &keys, 8, 0) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "answer takes 2 arguments");
        return NULL;
    }
    long tick = PyLong_AsLong(args[1]);
    if (tick == -1 && PyErr_Occurred()) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    const uint64_t *k = keys.buf;
    Py_ssize_t n = keys.len / 8, hits = 0;
    int64_t *rows = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    PyObject *columns[5] = {NULL}, *result = NULL;
    if (rows == NULL) {
        PyBuffer_Release(&keys);
        return PyErr_NoMemory();
    }
    long long previous = -1;
    for (; hits < n; hits++) {
        long long next = previous + 1, row;
        if (previous >= 0 && next < c->num_rows && c->hash[next] == k[hits] && c->kind[next])
            row = next; /* the run goes on: the next row holds the next block */
        else if ((row = find(c, k[hits])) < 0)
            break;
        rows[hits] = row;
        previous = row;
    }
    static const Py_ssize_t itemsize[5] = {8, 2, 4, 4, 4};
    for (int i = 0; i < 5; i++) {
        columns[i] = PyBytes_FromStringAndSize(NULL, hits * itemsize[i]);
        if (columns[i] == NULL) goto done;
    }
    uint64_t *hash = (uint64_t *)PyBytes_AS_STRING(columns[0]);
    uint16_t *kind = (uint16_t *)PyBytes_AS_STRING(columns[1]);
    uint32_t *file_id = (uint32_t *)PyBytes_AS_STRING(columns[2]);
    uint32_t *slot = (uint32_t *)PyBytes_AS_STRING(columns[3]);
    uint32_t *generation = (uint32_t *)PyBytes_AS_STRING(columns[4]);
    for (Py_ssize_t i = 0; i < hits; i++) {
        int64_t row = rows[i];
        hash[i] = c->hash[row];
        kind[i] = c->kind[row];
        file_id[i] = c->file_id[row];
        slot[i] = c->slot[row];
        generation[i] = c->generation[row];
        if (tick >= 0) c->access[row] = (uint16_t)tick;
    }
    PyObject *num_hits = PyLong_FromSsize_t(hits);
    result = num_hits ? PyTuple_New(6) : NULL;
    if (result == NULL) {
        Py_XDECREF(num_hits);
        goto done;
    }
    PyTuple_SET_ITEM(result, 0, num_hits);
    for (int i = 0; i < 5; i++) {
        PyTuple_SET_ITEM(result, i + 1, columns[i]); /* the tuple takes the reference */
        columns[i] = NULL;
    }
done:
    for (int i = 0; i < 5; i++) Py_XDECREF(columns[i]);
    PyMem_Free(rows);
    PyBuffer_Release(&keys);
    return result;
}

/* find_many(keys: uint64[n], out: int64[n]): each key's row, -1 if absent */
static PyObject *Core_find_many(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer keys, out;
    if (nargs != 2 || get_buffer(args[0], &keys, 8, 0) < 0) return NULL;
    if (get_buffer(args[1], &out, 8, 1) < 0) {
        PyBuffer_Release(&keys);
        return NULL;
    }
    const uint64_t *k = keys.buf;
    int64_t *rows = out.buf;
    Py_ssize_t n = keys.len / 8 < out.len / 8 ? keys.len / 8 : out.len / 8;
    for (Py_ssize_t start = 0; start < n; start += 64) {
        Py_ssize_t end = start + 64 < n ? start + 64 : n;
        prefetch(c, k + start, end - start, 1);
        for (Py_ssize_t i = start; i < end; i++) rows[i] = find(c, k[i]);
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* remove_rows(rows: int64[n]): live rows out of the index; their slots become tombstones */
static PyObject *Core_remove_rows(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer view;
    if (nargs != 1 || get_buffer(args[0], &view, 8, 0) < 0) return NULL;
    const int64_t *rows = view.buf;
    PyObject *result = Py_None;
    for (Py_ssize_t r = 0; r < view.len / 8; r++) {
        int64_t row = rows[r];
        if (row < 0 || row >= c->num_rows || c->kind[row] == 0) {
            PyErr_Format(PyExc_ValueError, "remove_rows: row %lld is not live", (long long)row);
            result = NULL;
            break;
        }
        long long i = home(c, c->hash[row]);
        while (row_of(c, c->slots[i]) != row) {
            if (c->slots[i] == EMPTY) {
                PyErr_Format(PyExc_RuntimeError, "remove_rows: row %lld is not indexed", (long long)row);
                result = NULL;
                break;
            }
            if (++i == c->size) i = 0;
        }
        if (result == NULL) break;
        c->slots[i] = TOMBSTONE;
        c->num_tombstones++;
        c->used_bytes -= (long long)c->kind_bytes[c->kind[row]];
        c->kind[row] = 0;
        c->num_live--;
    }
    PyBuffer_Release(&view);
    Py_XINCREF(result);
    return result;
}

/* insert_rows(rows: int64[n]): index rows whose hashes are not in the index */
static PyObject *Core_insert_rows(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer view;
    if (nargs != 1 || get_buffer(args[0], &view, 8, 0) < 0) return NULL;
    const int64_t *rows = view.buf;
    Py_ssize_t n = view.len / 8;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (rows[r] < 0 || rows[r] >= c->num_rows) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "insert_rows: a row out of range");
            return NULL;
        }
        if (r + 16 < n && rows[r + 16] >= 0 && rows[r + 16] < c->num_rows)
            __builtin_prefetch(&c->slots[home(c, c->hash[rows[r + 16]])]);
        if (insert(c, rows[r]) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* rehash(old_slots: uint32[m], old_row_bits, remap: int64[rows] or None): the entries of a
 * previous slots array (laid out with `old_row_bits`) into the current, empty one; row r
 * becomes remap[r] when given (a compaction). Taken in the old slots' order, nearly the
 * order of their homes, so the inserts walk the new slots forward; the rows' hashes, read
 * in no order, are prefetched a batch ahead. */
static PyObject *Core_rehash(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    enum { BATCH = 32 };
    Py_buffer old, remap = {0};
    if (nargs != 3 || get_buffer(args[0], &old, 4, 0) < 0) return NULL;
    long old_bits = PyLong_AsLong(args[1]);
    if (old_bits < 1 || old_bits > 32) {
        PyBuffer_Release(&old);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "rehash: bad old_row_bits");
        return NULL;
    }
    if (args[2] != Py_None && get_buffer(args[2], &remap, 8, 0) < 0) {
        PyBuffer_Release(&old);
        return NULL;
    }
    uint32_t old_mask = old_bits == 32 ? 0xFFFFFFFFu : (1u << old_bits) - 1;
    const uint32_t *slots = old.buf;
    const int64_t *to = remap.buf;
    Py_ssize_t num_old = old.len / 4, num_remap = remap.len / 8;
    long long rows[BATCH];
    PyObject *result = Py_None;
    c->num_tombstones = 0;
    for (Py_ssize_t start = 0; start < num_old && result != NULL; start += BATCH) {
        int count = 0;
        for (Py_ssize_t i = start; i < start + BATCH && i < num_old; i++) {
            uint32_t v = slots[i];
            if (v == EMPTY || v == TOMBSTONE) continue;
            long long row = (long long)(v & old_mask) - 1;
            if (to != NULL) row = row < num_remap ? to[row] : -1;
            if (row < 0 || row >= c->num_rows) {
                PyErr_SetString(PyExc_RuntimeError, "rehash: an entry maps to no row");
                result = NULL;
                break;
            }
            __builtin_prefetch(&c->hash[row]);
            rows[count++] = row;
        }
        for (int r = 0; r < count && result != NULL; r++)
            if (insert(c, rows[r]) < 0) result = NULL;
    }
    PyBuffer_Release(&old);
    if (to != NULL) PyBuffer_Release(&remap);
    Py_XINCREF(result);
    return result;
}

/* bind(hash, kind, file_id, slot, generation, access, capacity, slots, size, max_entries,
 *      kind_bytes, num_kinds, row_bits): the arrays' addresses (ints) and lengths, and the
 *      slots' layout, after any change */
static PyObject *Core_bind(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "bind takes 13 arguments");
        return NULL;
    }
    void *p[13];
    long long n[13];
    for (int i = 0; i < 13; i++) {
        if (i == 6 || i == 8 || i == 9 || i == 11 || i == 12)
            n[i] = PyLong_AsLongLong(args[i]);
        else
            p[i] = PyLong_AsVoidPtr(args[i]);
        if (PyErr_Occurred()) return NULL;
    }
    if (n[9] >= n[8]) {
        PyErr_SetString(PyExc_ValueError, "bind: max_entries must leave an empty slot");
        return NULL;
    }
    if (n[12] < 1 || n[12] > 32 || (n[12] < 32 && n[6] + 2 > (1ll << n[12]))) {
        PyErr_SetString(PyExc_ValueError, "bind: row_bits cannot number the columns' rows");
        return NULL;
    }
    c->hash = p[0];
    c->kind = p[1];
    c->file_id = p[2];
    c->slot = p[3];
    c->generation = p[4];
    c->access = p[5];
    c->capacity = n[6];
    c->slots = p[7];
    c->size = n[8];
    c->max_entries = n[9];
    c->kind_bytes = p[10];
    c->num_kinds = n[11];
    c->row_bits = (int)n[12];
    c->row_mask = c->row_bits == 32 ? 0xFFFFFFFFu : (1u << c->row_bits) - 1;
    Py_RETURN_NONE;
}

static PyMethodDef Core_methods[] = {
    {"put", (PyCFunction)(void (*)(void))Core_put, METH_FASTCALL, NULL},
    {"find_many", (PyCFunction)(void (*)(void))Core_find_many, METH_FASTCALL, NULL},
    {"answer", (PyCFunction)(void (*)(void))Core_answer, METH_FASTCALL, NULL},
    {"remove_rows", (PyCFunction)(void (*)(void))Core_remove_rows, METH_FASTCALL, NULL},
    {"insert_rows", (PyCFunction)(void (*)(void))Core_insert_rows, METH_FASTCALL, NULL},
    {"rehash", (PyCFunction)(void (*)(void))Core_rehash, METH_FASTCALL, NULL},
    {"bind", (PyCFunction)(void (*)(void))Core_bind, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Core_members[] = {
    {"num_rows", T_LONGLONG, offsetof(Core, num_rows), 0, NULL},
    {"num_live", T_LONGLONG, offsetof(Core, num_live), 0, NULL},
    {"num_tombstones", T_LONGLONG, offsetof(Core, num_tombstones), 0, NULL},
    {"used_bytes", T_LONGLONG, offsetof(Core, used_bytes), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_kv_row_index.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_methods = Core_methods,
    .tp_members = Core_members,
};

/* use_block_type(StoredBlock): read its fields from their slots, not by attribute lookup */
static PyObject *use_block_type(PyObject *module, PyObject *type) {
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "use_block_type takes a type");
        return NULL;
    }
    Py_ssize_t offsets[5];
    for (int f = 0; f < 5; f++) {
        PyObject *descr = PyObject_GetAttr(type, field_names[f]);
        if (descr == NULL) return NULL;
        int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
                 ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
        if (ok) offsets[f] = ((PyMemberDescrObject *)descr)->d_member->offset;
        Py_DECREF(descr);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "%R.%s is not an object slot", type, FIELD_NAMES[f]);
            return NULL;
        }
    }
    memcpy(field_offsets, offsets, sizeof offsets);
    Py_XSETREF(block_type, (PyTypeObject *)Py_NewRef(type));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"use_block_type", use_block_type, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_kv_row_index", NULL, -1, module_methods,
};

PyMODINIT_FUNC PyInit__kv_row_index(void) {
    for (int f = 0; f < 5; f++) {
        field_names[f] = PyUnicode_InternFromString(FIELD_NAMES[f]);
        if (field_names[f] == NULL) return NULL;
    }
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
