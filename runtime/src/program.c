/* placeholder */
typedef int ekv_placeholder_program;
