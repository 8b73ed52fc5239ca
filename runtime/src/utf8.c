/* placeholder */
typedef int ekv_placeholder_utf8;
