/* placeholder */
typedef int ekv_placeholder_cpu_check;
