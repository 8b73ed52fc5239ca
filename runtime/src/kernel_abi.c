/* placeholder */
typedef int ekv_placeholder_kernel_abi;
