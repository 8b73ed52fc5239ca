/* placeholder */
typedef int ekv_placeholder_device_cpu;
