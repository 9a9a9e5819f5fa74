/* pjrt_crosshost.h — the cross-host transfers extension (version-8 layout,
 * written from docs/ABI-cross-host.md) and the plugin's own exports.
 *
 * Include after xla/pjrt/c/pjrt_c_api.h. Plain C: usable by bindgen, by C
 * programs and (by hand) from ctypes. */
#ifndef PJRT_CROSSHOST_H_
#define PJRT_CROSSHOST_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "xla/pjrt/c/pjrt_c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PJRT_CROSSHOST_STRUCT_SIZE(type, last) \
  (offsetof(type, last) + sizeof(((type*)0)->last))

/* ------------------------------------------------------------------------- */
/* Cross-host transfers extension (PJRT_Extension_Type_CrossHostTransfers).   */
/* ------------------------------------------------------------------------- */

#define PJRT_API_CROSS_HOST_TRANSFERS_EXTENSION_VERSION 8

typedef void (*PJRT_Transfers_CrossHostOnCanceledCallback)(PJRT_Error* error,
                                                           void* user_arg);

typedef void (*PJRT_Transfers_CrossHostRecvCancelNotifier)(
    const char* serialized_descriptor, size_t serialized_descriptor_size,
    PJRT_Error_Code reason, const char* error_message,
    size_t error_message_size,
    PJRT_Transfers_CrossHostOnCanceledCallback on_canceled,
    void* on_canceled_user_arg, void* user_arg);

typedef void (*PJRT_Transfers_CrossHostRecvNotifier)(
    PJRT_Error* error, const char** serialized_descriptors,
    size_t* descriptors_sizes, size_t num_descriptors, void* user_arg,
    PJRT_Transfers_CrossHostRecvCancelNotifier cancel_notifier,
    void* cancel_notifier_user_arg);

typedef struct PJRT_Transfers_CrossHostRecvNotifierInfo {
  void* user_arg;
  PJRT_Transfers_CrossHostRecvNotifier notifier;
} PJRT_Transfers_CrossHostRecvNotifierInfo;

typedef struct PJRT_Transfers_CrossHostRemoteSendCallbackInfo {
  void* user_arg;
  void (*on_done)(PJRT_Error* error, bool sends_were_enqueued, void* user_arg);
} PJRT_Transfers_CrossHostRemoteSendCallbackInfo;

/* v1, receiver side. */
typedef struct PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Client* client;
  size_t num_shapes;
  size_t* shape_num_dims;
  const int64_t** num_dims;
  PJRT_Buffer_Type* element_types;
  PJRT_Buffer_MemoryLayout** layouts;
  PJRT_Device* device;
  PJRT_Transfers_CrossHostRecvNotifierInfo notifier;
  PJRT_Buffer** buffers;  /* out, caller-allocated, num_shapes entries */
  size_t num_buffers;     /* out */
  bool allow_cancel_notifier; /* v7 */
} PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args;
#define PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args_STRUCT_SIZE \
  PJRT_CROSSHOST_STRUCT_SIZE(                                                  \
      PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args,             \
      allow_cancel_notifier)

typedef PJRT_Error* PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers(
    PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args* args);

/* v1, sender side. */
typedef struct PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Buffer* buffer;
  PJRT_Event* event; /* may be null; the plugin takes ownership */
  char** serialized_descriptor;
  size_t* serialized_descriptor_size;
  PJRT_Transfers_CrossHostRemoteSendCallbackInfo on_done;
  void (*descriptor_destructor)(char** descriptor_data,
                                size_t* descriptor_size); /* v6 */
} PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args;
#define PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args_STRUCT_SIZE \
  PJRT_CROSSHOST_STRUCT_SIZE(                                         \
      PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args,             \
      descriptor_destructor)

typedef void PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice(
    PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args* args);

/* v2, receiver side. */
typedef struct PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Client* client;
  size_t num_shapes;
  size_t* shape_num_dims;
  const int64_t** num_dims;
  PJRT_Buffer_Type* element_types;
  PJRT_Buffer_MemoryLayout** layouts;
  PJRT_Device* device;
  const int32_t* src_global_device_ids;
  const int64_t* transfer_keys;
  PJRT_Buffer** buffers; /* out, caller-allocated, num_shapes entries */
  size_t num_tasks;              /* v8 */
  const int* task_ids;           /* v8 */
  const int64_t* incarnation_ids; /* v8 */
} PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args;
#define PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args_STRUCT_SIZE \
  PJRT_CROSSHOST_STRUCT_SIZE(                                              \
      PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args,             \
      incarnation_ids)

typedef PJRT_Error* PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers(
    PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args* args);

/* v2, sender side. */
typedef struct PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  PJRT_Client* client;
  size_t num_buffers;
  PJRT_Buffer** buffers;
  const int32_t* dst_global_device_ids;
  const int64_t* transfer_keys;
  PJRT_Event** send_events; /* out, caller-allocated, num_buffers entries */
  size_t num_tasks;              /* v8 */
  const int* task_ids;           /* v8 */
  const int64_t* incarnation_ids; /* v8 */
} PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args;
#define PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args_STRUCT_SIZE \
  PJRT_CROSSHOST_STRUCT_SIZE(                                           \
      PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args,             \
      incarnation_ids)

typedef PJRT_Error* PJRT_Transfers_PJRT_Client_CrossHostSendBuffers(
    PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args* args);

typedef struct PJRT_CrossHostTransfers_Extension {
  PJRT_Extension_Base base;
  PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers*
      PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers;
  PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice*
      PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice;
  PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers*
      PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers;
  PJRT_Transfers_PJRT_Client_CrossHostSendBuffers*
      PJRT_Transfers_PJRT_Client_CrossHostSendBuffers;
} PJRT_CrossHostTransfers_Extension;

/* ------------------------------------------------------------------------- */
/* KV delete extension for PJRT_Client_Create_Args.extension_start.          */
/* The PJRT C API has no delete callback; a framework that knows this plugin  */
/* attaches this struct so that completion receipts are retired for real.     */
/* ------------------------------------------------------------------------- */

/* Outside upstream's PJRT_Extension_Type enum on purpose. */
#define PJRT_CROSSHOST_EXTENSION_TYPE_KV_DELETE 0x43480001

typedef struct PJRT_CrossHost_KeyValueDeleteCallback_Args {
  size_t struct_size;
  PJRT_Extension_Base* extension_start;
  const char* key;
  size_t key_size;
  PJRT_CallbackError* callback_error;
  void* user_arg;
} PJRT_CrossHost_KeyValueDeleteCallback_Args;
#define PJRT_CrossHost_KeyValueDeleteCallback_Args_STRUCT_SIZE \
  PJRT_CROSSHOST_STRUCT_SIZE(PJRT_CrossHost_KeyValueDeleteCallback_Args, user_arg)

/* Deleting an absent key is not an error. */
typedef PJRT_Error* (*PJRT_CrossHost_KeyValueDeleteCallback)(
    PJRT_CrossHost_KeyValueDeleteCallback_Args* args);

typedef struct PJRT_CrossHost_KvDeleteExtension {
  PJRT_Extension_Base base; /* type = PJRT_CROSSHOST_EXTENSION_TYPE_KV_DELETE */
  PJRT_CrossHost_KeyValueDeleteCallback kv_delete_callback;
  void* kv_delete_user_arg;
} PJRT_CrossHost_KvDeleteExtension;
#define PJRT_CrossHost_KvDeleteExtension_STRUCT_SIZE \
  PJRT_CROSSHOST_STRUCT_SIZE(PJRT_CrossHost_KvDeleteExtension, kv_delete_user_arg)

/* ------------------------------------------------------------------------- */
/* Plugin exports.                                                            */
/* ------------------------------------------------------------------------- */

/* JSON snapshot of the client's transfer metrics, or NULL for a null/invalid
 * client. Free with pjrt_crosshost_free_string. Keys: keys_created,
 * keys_deleted, delete_failures, keys_outstanding, stale_receipts_rejected,
 * cancellations, timeouts, bytes_received, bytes_sent. */
char* pjrt_crosshost_metrics_json(const PJRT_Client* client);
void pjrt_crosshost_free_string(char* s);

/* The transfer timeline's marks recorded so far in this process, as JSON
 * `[[nanoseconds, "point", "key hash", thread], ...]` (CLOCK_MONOTONIC, so
 * two processes' marks line up), emptying the record; `[]` unless the
 * process was started with PJRT_CROSSHOST_TIMELINE=1. Free with
 * pjrt_crosshost_free_string. */
char* pjrt_crosshost_timeline_json(void);

/* JSON array with one {"process_index":N,"metrics":{...}} object per live
 * client of this process (for frameworks such as JAX that never expose their
 * PJRT_Client*). Free with pjrt_crosshost_free_string. */
char* pjrt_crosshost_live_clients_metrics_json(void);

/* Registers a process-wide KV delete for clients whose PJRT_Client_Create
 * args carry no PJRT_CrossHost_KvDeleteExtension (JAX cannot attach one;
 * jax_plugins.crosshost registers a delete through JAX's distributed
 * client). It is called with user_arg in its args, on the plugin's own
 * delete workers, after the buffer's outcome is published; deleting an
 * absent key must not be an error. NULL unregisters: no new call starts,
 * and it returns once the calls in flight returned (0), or after 5 s with
 * calls still in flight (1). A process forked after registering never
 * calls it. Returns -1 on an internal error. */
int pjrt_crosshost_set_kv_delete(PJRT_CrossHost_KeyValueDeleteCallback callback,
                                 void* user_arg);

/* The doctor: what this process would use (library, compute plugin, libucp
 * and what it can do, the address it would advertise) and, given a job
 * (num_nodes > 1 with doctor.coordinator=host:port or kv_store=etcd://...,
 * run in every process), whether each peer's control link and TCP data port
 * answer, with round-trip times. `request`: NUL-terminated key=value lines
 * (create options, doctor.coordinator, doctor.timeout_ms), or NULL. Returns
 * JSON: {"ok": bool, "problems": [{"problem", "change"}], one object per
 * section, "text": the report for a person}; it may block for the job's
 * session timeout. Free with pjrt_crosshost_free_string. */
char* pjrt_crosshost_doctor_json(const char* request);

#ifdef __cplusplus
}
#endif

#endif /* PJRT_CROSSHOST_H_ */
