/* The part of NCCL's C API that the emulated NCCL implements, with NCCL's types, enum values and
 * signatures (nccl.h of NCCL 2.18+), so that the library is a drop-in for libnccl.so.2 behind
 * crates/parallel/src/nccl_lib.rs. Written for this project from NCCL's documented API. */
#ifndef FERRO_NCCL_API_H
#define FERRO_NCCL_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FERRO_NCCL_EXPORT __attribute__((visibility("default")))

/* The version the emulator reports: 2.23.4 (NCCL's code: major*10000 + minor*100 + patch). */
#define FERRO_NCCL_EMU_VERSION 22304

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
    ncclNumResults = 8
} ncclResult_t;

typedef enum {
    ncclInt8 = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclFloat32 = 7,
    ncclFloat64 = 8,
    ncclBfloat16 = 9,
    ncclNumTypes = 10
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5 } ncclRedOp_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

#define NCCL_SPLIT_NOCOLOR -1

typedef struct ncclComm* ncclComm_t;
/* Opaque here: the emulator accepts and ignores a configuration (NULL is fine). */
typedef struct ncclConfig_v21700 ncclConfig_t;
/* On the emulated device a stream points at a struct whose first member is
   `const ferro_emu_stream_ops*` (crates/cuda/emu/ferro_emu_stream.h); NULL runs at call time. */
typedef void* cudaStream_t;

FERRO_NCCL_EXPORT ncclResult_t ncclGetVersion(int* version);
FERRO_NCCL_EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
FERRO_NCCL_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
FERRO_NCCL_EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config);
FERRO_NCCL_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm);
FERRO_NCCL_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm);
FERRO_NCCL_EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
FERRO_NCCL_EXPORT ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
FERRO_NCCL_EXPORT ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
FERRO_NCCL_EXPORT const char* ncclGetErrorString(ncclResult_t result);
FERRO_NCCL_EXPORT const char* ncclGetLastError(ncclComm_t comm);

FERRO_NCCL_EXPORT ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                             ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
FERRO_NCCL_EXPORT ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                                             ncclComm_t comm, cudaStream_t stream);
FERRO_NCCL_EXPORT ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                                                 ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
FERRO_NCCL_EXPORT ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                                             ncclComm_t comm, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* FERRO_NCCL_API_H */
